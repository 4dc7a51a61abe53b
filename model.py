"""Tokenizer and model behind one small interface (DESIGN §5).

The algorithm (lopd.py, train.py) only needs: encode/decode, a few special token ids
for the turn structure, the embedding matrix (to build `inputs_embeds`), and a causal
LM that accepts `inputs_embeds`. Two ways to get them:

- default: a byte-level `tiktoken.Encoding` built offline (256 byte ranks, no merges,
  plus the special tokens below) and a tiny Llama built from a `transformers` config
  with random weights. Nothing is downloaded.
- `--model NAME_OR_PATH`: any `transformers` causal LM and its tokenizer; the special
  tokens are added to its vocabulary (and the embedding matrix resized) if missing.

A conversation is laid out as

    <|bos|> <|obs|> task <|agent|> action <|eot|> <|obs|> result <|agent|> action <|eot|> ...

and the teacher's privileged context goes between <|bos|><|ctx|> and the first <|obs|>.
"""
import inspect

import tiktoken
import torch

SPECIALS = ['<|bos|>', '<|obs|>', '<|agent|>', '<|eot|>', '<|ctx|>', '<|pad|>']


class Tokenizer:
    """encode/decode plus the ids of the turn-structure specials, for either backend."""

    def __init__(self, enc=None, hf=None):
        self.enc, self.hf = enc, hf
        if enc is not None:
            ids = {s: enc.encode_single_token(s) for s in SPECIALS}
            self.vocab_size = enc.n_vocab
        else:
            hf.add_special_tokens({'additional_special_tokens': SPECIALS})
            ids = {s: hf.convert_tokens_to_ids(s) for s in SPECIALS}
            self.vocab_size = len(hf)
        self.bos, self.obs, self.agent, self.eot, self.ctx, self.pad = (ids[s] for s in SPECIALS)

    def encode(self, text):
        # plain text only: special-token strings inside model or env text stay literal bytes
        if self.enc is not None:
            return self.enc.encode_ordinary(text)
        return self.hf.encode(text, add_special_tokens=False, split_special_tokens=True)

    def decode(self, ids):
        if self.enc is not None:
            return self.enc.decode([i for i in ids if i < 256], errors='replace')
        return self.hf.decode(ids, skip_special_tokens=True)


def byte_tokenizer():
    """A byte-level tiktoken Encoding built offline: every byte is a token, no merges."""
    enc = tiktoken.Encoding(
        name='bytes+turns',
        pat_str=r"""\S+|\s+""",
        mergeable_ranks={bytes([i]): i for i in range(256)},
        special_tokens={s: 256 + i for i, s in enumerate(SPECIALS)},
    )
    return Tokenizer(enc=enc)


def tiny_llama(vocab_size, d_model=128, n_layer=4, n_head=4, max_len=512):
    """A ~0.9M-parameter Llama with random weights (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM  # imported here: `train.py -h` stays fast
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=d_model, intermediate_size=3 * d_model,
                      num_hidden_layers=n_layer, num_attention_heads=n_head, num_key_value_heads=n_head,
                      max_position_embeddings=max_len, tie_word_embeddings=True,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(cfg)


def load(model_name=None, d_model=128, n_layer=4):
    """-> (tokenizer, model). model_name None = the offline byte tokenizer + tiny Llama."""
    if model_name is None:
        tok = byte_tokenizer()
        return tok, tiny_llama(tok.vocab_size, d_model, n_layer)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = Tokenizer(hf=AutoTokenizer.from_pretrained(model_name))
    model = AutoModelForCausalLM.from_pretrained(model_name)
    if model.get_input_embeddings().weight.shape[0] < tok.vocab_size:
        model.resize_token_embeddings(tok.vocab_size)
    return tok, model


def embed(model, ids):
    """Token ids (any shape) -> the model's input embeddings (…, d)."""
    return model.get_input_embeddings()(ids)


def hidden(model, ids, mask):
    """Last-layer hidden states of token ids (B, L) with right padding -> (B, L, d)."""
    out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    return out.hidden_states[-1]


def forward(model, embeds, mask, past=None, pos=None, use_cache=False):
    """One causal forward from `inputs_embeds`. embeds (B, L, d), mask (B, L_total) 1 = real.

    Position ids follow the mask (left padding gets no positions), so a row's logits do
    not depend on how much padding the batch put in front of it. -> (logits, cache)."""
    if pos is None:
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -embeds.shape[1]:]  # (B, L)
    kw = {CACHE_KW[type(model)]: past} if past is not None else {}
    out = model(inputs_embeds=embeds, attention_mask=mask, position_ids=pos, use_cache=use_cache, **kw)
    cache = (out['cache'] if 'cache' in out else out.get('past_key_values')) if use_cache else None
    return out.logits, cache


class _CacheKw(dict):
    """transformers 5.x renamed `past_key_values` to `cache`; look the name up once per class."""
    def __missing__(self, cls):
        self[cls] = 'cache' if 'cache' in inspect.signature(cls.forward).parameters else 'past_key_values'
        return self[cls]


CACHE_KW = _CacheKw()
