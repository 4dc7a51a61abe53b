"""`--model PATH` with a transformers causal LM and tokenizer that this test builds and saves
itself (a byte-level BPE with no merges and a 1-layer Llama): nothing is downloaded."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, ROOT)
import model as M  # noqa: E402



@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    d = tmp_path_factory.mktemp("hf")
    PreTrainedTokenizerFast(tokenizer_object=tk).save_pretrained(d)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024)
    LlamaForCausalLM(cfg).save_pretrained(d)
    return d


def test_load_adds_the_turn_specials_and_resizes(hf_dir):
    tok, model = M.load(str(hf_dir))
    ids = [tok.bos, tok.obs, tok.agent, tok.eot, tok.ctx, tok.pad]
    assert len(set(ids)) == 6 and min(ids) >= 256                   # new tokens after the 256 bytes
    assert model.get_input_embeddings().weight.shape[0] >= tok.vocab_size
    assert tok.decode(tok.encode("city(bo) -> oslo")) == "city(bo) -> oslo"
    assert "<|eot|>" in tok.decode(tok.encode("a <|eot|> b"))          # env text never becomes a special
    assert tok.eot not in tok.encode("a <|eot|> b")


@pytest.mark.slow
def test_train_runs_with_model_path(hf_dir, tmp_path):
    r = subprocess.run([sys.executable, "train.py", "--model", str(hf_dir), "--episodes", "32", "--batch", "16",
                        "--warmup_steps", "3", "--warmup_batch", "8", "--init_episodes", "16",
                        "--cold_start_steps", "2", "--eval_every", "1", "--teacher_eval", "4", "--eval_tasks", "10",
                        "--out_dir", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1].startswith("lopd-tooluse-s0: held-out reward")
    assert (tmp_path / "lopd-tooluse-s0" / "summary.json").exists()
