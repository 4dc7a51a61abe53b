"""Tokenizer and model behind one small interface, and the token-level helpers on top of it.

The algorithm (lopd.py, methods.py, train.py) only needs: encode/decode, a few special
token ids for the turn structure, the embedding matrix (to build `inputs_embeds`), and a
causal LM that accepts `inputs_embeds`. Two ways to get them:

- default: a small BPE `tiktoken.Encoding` trained offline on the text the model will read
  (256 byte ranks plus merges learned by `bpe_ranks`, plus the special tokens below; it
  cuts every sequence about 3x against bytes) and a tiny Llama built from a `transformers`
  config with random weights. Nothing is downloaded. `--tokenizer bytes` keeps plain bytes.
- `--model NAME_OR_PATH`: any `transformers` causal LM and its tokenizer; the special
  tokens are added to its vocabulary (and the embedding matrix resized) if missing.

A conversation is laid out as

    <|bos|> <|obs|> task <|agent|> action <|eot|> <|obs|> result <|agent|> action <|eot|> ...

and the teacher's privileged context goes between <|bos|><|ctx|> and the first <|obs|>.

On top of that interface: an episode as tokens and its agent-token mask (`encode_episode`),
right-padded batches (`pad_batch`), the two kinds of context prefix (`bos_prefix` for the
student, `text_prefix` for a teacher told something in words), KV-cached decoding of one
agent turn (`generate`) and scoring every prefix of a batch in one forward (`logits_on`).
"""
import collections
import hashlib
import inspect
import re

import tiktoken
import torch

import lopd

MAX_OBS_CHARS = 100  # observations are cut to this many characters before tokenizing

SPECIALS = ['<|bos|>', '<|obs|>', '<|agent|>', '<|eot|>', '<|ctx|>', '<|pad|>']


class Tokenizer:
    """encode/decode plus the ids of the turn-structure specials, for either backend."""

    def __init__(self, enc=None, hf=None):
        self.enc, self.hf = enc, hf
        if enc is not None:
            ids = {s: enc.encode_single_token(s) for s in SPECIALS}
            self.vocab_size, self.n_ordinary = enc.n_vocab, enc.n_vocab - len(SPECIALS)
        else:
            hf.add_special_tokens({'additional_special_tokens': SPECIALS})
            ids = {s: hf.convert_tokens_to_ids(s) for s in SPECIALS}
            self.vocab_size = len(hf)
        self.bos, self.obs, self.agent, self.eot, self.ctx, self.pad = (ids[s] for s in SPECIALS)

    def digest(self):
        """A short hash of the vocabulary (ranks and specials), so that caches built on another tokenizer are not reused."""
        vocab = sorted(self.enc._mergeable_ranks.items()) if self.enc is not None else sorted(self.hf.get_vocab().items())
        return hashlib.sha1(repr(vocab).encode()).hexdigest()[:10]

    def encode(self, text):
        # plain text only: special-token strings inside model or env text stay literal bytes
        if self.enc is not None:
            return self.enc.encode_ordinary(text)
        return self.hf.encode(text, add_special_tokens=False, split_special_tokens=True)

    def decode(self, ids):
        if self.enc is not None:
            return self.enc.decode([i for i in ids if i < self.n_ordinary], errors='replace')
        return self.hf.decode(ids, skip_special_tokens=True)


# pre-tokenization (GPT-2's, simplified): words with their leading space, single digits, runs of
# punctuation, and whitespace that leaves its last space to the next word
PAT = r""" ?[A-Za-z_]+| ?[0-9]| ?[^A-Za-z0-9_\s]+|\s+(?!\S)|\s+"""


def bpe_ranks(texts, n_merges):
    """Byte-pair merges learned from texts -> tiktoken's mergeable_ranks (256 bytes, then the merges).

    Classic BPE (Sennrich et al. 2016), as tiktoken's educational trainer does it, but over word
    counts instead of the running text, so a corpus of thousands of demos trains in a second.
    Each round merges the most frequent adjacent pair inside words (ties: the larger pair bytes,
    so the result does not depend on dict order); a merge's rank is its round, which is the
    order tiktoken applies them in."""
    words = collections.Counter(w.encode() for t in texts for w in re.findall(PAT, t))
    pieces = {w: [bytes([b]) for b in w] for w in words}
    ranks = {bytes([i]): i for i in range(256)}
    for _ in range(n_merges):
        pairs = collections.Counter()
        for w, c in words.items():
            p = pieces[w]
            for a, b in zip(p, p[1:]):
                pairs[a, b] += c
        if not pairs:
            break
        a, b = max(pairs, key=lambda x: (pairs[x], x))
        ranks[a + b] = len(ranks)
        for w, p in pieces.items():
            i, out = 0, []
            while i < len(p):
                if i + 1 < len(p) and p[i] == a and p[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(p[i])
                    i += 1
            pieces[w] = out
    return ranks


def byte_tokenizer(texts=None, n_merges=0):
    """A tiktoken Encoding built offline: every byte is a token, plus n_merges BPE merges learned
    from texts (none: plain bytes), plus the turn-structure specials."""
    ranks = bpe_ranks(texts, n_merges) if texts and n_merges else {bytes([i]): i for i in range(256)}
    enc = tiktoken.Encoding(
        name=f'bpe{len(ranks) - 256}+turns',
        pat_str=PAT,
        mergeable_ranks=ranks,
        special_tokens={s: len(ranks) + i for i, s in enumerate(SPECIALS)},
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


def load(model_name=None, d_model=128, n_layer=4, texts=None, n_merges=0):
    """-> (tokenizer, model). model_name None = the offline tokenizer (BPE learned on texts, or
    bytes) + tiny Llama."""
    if model_name is None:
        tok = byte_tokenizer(texts, n_merges)
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


# ----------------------------------------------------------------------------- tokens of an episode

def obs_ids(tok, text):
    return [tok.obs] + tok.encode(text[:MAX_OBS_CHARS]) + [tok.agent]


def encode_episode(tok, ep):
    """An episode as the student sees it (no <|bos|>) and its agent-token mask.

    <|obs|> task <|agent|> a1 <|eot|> <|obs|> o1 <|agent|> a2 <|eot|> ...
    mask = 1 on action tokens and their <|eot|> (what the agent generated), 0 elsewhere."""
    ids = obs_ids(tok, ep.task.prompt)
    mask = [0] * len(ids)
    for action, obs in ep.turns:
        a = tok.encode(action) + [tok.eot]
        ids, mask = ids + a, mask + [1] * len(a)
        if obs:
            o = obs_ids(tok, obs)
            ids, mask = ids + o, mask + [0] * len(o)
    return ids, mask


def pad_batch(seqs, masks, pad, device):
    """Right-pad bodies -> ids (B, T), agent mask (B, T), attention mask (B, T)."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad, dtype=torch.long)
    amask = torch.zeros(len(seqs), T)
    attn = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        ids[i, :len(s)], amask[i, :len(s)], attn[i, :len(s)] = torch.tensor(s), torch.tensor(m, dtype=torch.float), 1
    return ids.to(device), amask.to(device), attn.to(device)


# ----------------------------------------------------------------------------- contexts, decoding, scoring

def bos_prefix(model, tok, n):
    """The student's 'context': just <|bos|>, as (1, d) embeddings per row."""
    return [embed(model, torch.tensor([tok.bos], device=model.device))] * n


def text_prefix(model, tok, texts):
    """<|bos|><|ctx|> text, embedded by the teacher: a privileged context given as text."""
    return [embed(model, torch.tensor([tok.bos, tok.ctx] + tok.encode(t), device=model.device)) for t in texts]


@torch.no_grad()
def generate(model, tok, prefixes, bodies, max_new, greedy):
    """Sample one agent turn per row, with a KV cache, until <|eot|> or max_new tokens.

    prefixes: list of (P_i, d) context embeddings; bodies: list of token lists.
    Rows are left-padded so that every row's next token is at the last position."""
    rows = [torch.cat([p, embed(model, torch.tensor(b, device=model.device))]) for p, b in zip(prefixes, bodies)]
    L, B = max(r.shape[0] for r in rows), len(rows)
    E = rows[0].new_zeros(B, L, rows[0].shape[1])
    mask = torch.zeros(B, L, dtype=torch.long, device=model.device)
    for i, r in enumerate(rows):
        E[i, L - r.shape[0]:], mask[i, L - r.shape[0]:] = r, 1
    logits, cache = forward(model, E, mask, use_cache=True)
    pos = mask.sum(-1, keepdim=True) - 1                                        # (B, 1) position of the last token
    out, done = [[] for _ in range(B)], torch.zeros(B, dtype=torch.bool, device=model.device)
    for _ in range(max_new):
        last = logits[:, -1].float()                                            # (B, V)
        nxt = last.argmax(-1) if greedy else torch.multinomial(torch.softmax(last, -1), 1).squeeze(-1)
        for i in (~done).nonzero().flatten().tolist():
            out[i].append(int(nxt[i]))
        done |= nxt == tok.eot
        if done.all():
            break
        mask, pos = torch.cat([mask, torch.ones_like(mask[:, :1])], 1), pos + 1
        logits, cache = forward(model, embed(model, nxt[:, None]), mask, past=cache, pos=pos, use_cache=True)
    return out


def logits_on(model, prefixes, ids, attn):
    """Score every prefix of the trajectories in one forward: (B, T, V), where row i,
    position t is π(· | context_i, body_i[:t]), i.e. the distribution of body token t."""
    E, mask, P = lopd.teacher_inputs(prefixes, embed(model, ids), attn)
    logits, _ = forward(model, E, mask)
    return logits[:, P - 1:P - 1 + ids.shape[1]]
