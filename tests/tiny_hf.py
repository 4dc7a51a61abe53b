"""Tiny random transformers models of real architectures, and a byte-level tokenizer with a ChatML
chat template, built offline and saved to a folder that `train.py --model` reads. Nothing is downloaded."""

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

ARCHS = ('llama', 'qwen2', 'qwen3', 'gpt2')


def tokenizer(chat=True, merges=0):
    """Byte-level BPE (GPT-2's alphabet, no merges: every byte a token), with <|im_start|>/<|im_end|>
    and the ChatML template when chat, else no template (the turn specials are then added by model.py)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    if not chat:
        return PreTrainedTokenizerFast(tokenizer_object=tk)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token='<|im_end|>', pad_token='<|endoftext|>',
                                   additional_special_tokens=['<|im_start|>'], chat_template=CHATML)


def config(arch, vocab_size, d=32, layers=2):
    import transformers as tf
    common = dict(vocab_size=vocab_size, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if arch == 'gpt2':
        return tf.GPT2Config(n_embd=d, n_layer=layers, n_head=2, n_positions=2048, resid_pdrop=0.0, embd_pdrop=0.0,
                             attn_pdrop=0.0, **common)
    kw = dict(hidden_size=d, intermediate_size=2 * d, num_hidden_layers=layers, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=2048, **common)
    return {'llama': tf.LlamaConfig, 'qwen2': tf.Qwen2Config, 'qwen3': lambda **k: tf.Qwen3Config(head_dim=d // 2, **k)}[arch](**kw)


def save(folder, arch='qwen3', chat=True, d=32, layers=2, seed=0):
    """Build and save a random model of `arch` and its tokenizer in folder -> folder."""
    import torch
    from transformers import AutoModelForCausalLM
    tok = tokenizer(chat)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config(arch, len(tok), d, layers)).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


if __name__ == '__main__':
    import sys
    print(save(sys.argv[1], *(sys.argv[2:3] or [])))
