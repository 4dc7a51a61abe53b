"""The tokenizer behind one small interface, for the tiny model and for a transformers model.

    Tokenizer       encode/decode, the turn layout's pieces (head, context_head, turn, eot)
    chat_layout     a chat template's turns, found by rendering conversations with markers
    bpe_ranks       byte-pair merges learned offline from the environment's text
    byte_tokenizer  the tiny model's tiktoken Encoding: bytes + merges + the turn specials

The tiny model's conversation is laid out as

    <|bos|> <|obs|> task <|agent|> action <|eot|> <|obs|> result <|agent|> action <|eot|> ...

and the teacher's privileged context goes between <|bos|><|ctx|> and the first <|obs|>; a
model with a chat template uses its own turns instead (`chat_layout`).
"""
import collections
import hashlib
import re

import tiktoken

MAX_OBS_CHARS = 100  # observations are cut to this many characters before tokenizing

SPECIALS = ['<|bos|>', '<|obs|>', '<|agent|>', '<|eot|>', '<|ctx|>', '<|pad|>']


class Tokenizer:
    """encode/decode plus the pieces of the turn layout, for either backend.

    Two layouts. The special-token one (the tiny model, and a tokenizer without a chat template):
    the six SPECIALS above. The chat-template one (a tokenizer that has a template): the model's own
    turns, cut out of the template's rendering by `chat_layout`; the task and each observation are
    user turns, each action an assistant turn, the privileged context sits in the first user turn
    in front of the task (where the LOPD paper's code puts its latents). Either way the algorithm
    only asks for `head` (the student's context), `context_head` (what goes before a privileged
    context), `turn(text, first)` (an observation up to where the agent speaks) and `eot`."""

    def __init__(self, enc=None, hf=None, system=None):
        self.enc, self.hf, self.chat = enc, hf, None
        if enc is not None:
            ids = {s: enc.encode_single_token(s) for s in SPECIALS}
            self.vocab_size, self.n_ordinary = enc.n_vocab, enc.n_vocab - len(SPECIALS)
        elif getattr(hf, 'chat_template', None):
            self.chat = chat_layout(hf, system)
            ids = dict(zip(SPECIALS, [None] * len(SPECIALS)), **{'<|eot|>': self.chat['eot']})
            ids['<|pad|>'] = hf.pad_token_id if hf.pad_token_id is not None else self.chat['eot']
            self.vocab_size = len(hf)
        else:
            hf.add_special_tokens({'additional_special_tokens': SPECIALS})
            ids = {s: hf.convert_tokens_to_ids(s) for s in SPECIALS}
            self.vocab_size = len(hf)
        self.bos, self.obs, self.agent, self.eot, self.ctx, self.pad = (ids[s] for s in SPECIALS)

    def digest(self):
        """A short hash of the vocabulary (ranks and specials) and the layout, so that caches built on another tokenizer are not reused."""
        vocab = sorted(self.enc._mergeable_ranks.items()) if self.enc is not None else sorted(self.hf.get_vocab().items())
        return hashlib.sha1(repr((vocab, self.chat) if self.chat else vocab).encode()).hexdigest()[:10]

    def encode(self, text):
        # plain text only: special-token strings inside model or env text stay literal bytes
        if self.enc is not None:
            return self.enc.encode_ordinary(text)
        return self.hf.encode(text, add_special_tokens=False, split_special_tokens=True)

    def decode(self, ids):
        if self.enc is not None:
            return self.enc.decode([i for i in ids if i < self.n_ordinary], errors='replace')
        return self.hf.decode(ids, skip_special_tokens=True)

    def head(self):
        """The student's context: <|bos|>, or the template up to the first user turn's text."""
        return list(self.chat['head']) if self.chat else [self.bos]

    def context_head(self):
        """What comes before a privileged context's text: <|bos|><|ctx|>, or the same head (the
        context is the start of the first user turn, the task follows it in the body)."""
        return list(self.chat['head']) if self.chat else [self.bos, self.ctx]

    def turn(self, text, first=False):
        """An observation (the task when first) up to where the agent speaks:
        <|obs|> text <|agent|>, or [the rest of the assistant's close, a user turn's open] text [user close, assistant open]."""
        body = self.encode(text[:MAX_OBS_CHARS])
        if not self.chat:
            return [self.obs] + body + [self.agent]
        return ([] if first else list(self.chat['user'])) + body + list(self.chat['assistant'])


def chat_layout(hf, system=None):
    """The pieces of a chat template, found by rendering conversations with markers:

        head ⟨T1⟩ assistant ⟨A1⟩ eot user ⟨T2⟩ assistant      (assistant = user close + the generation prompt)

    system: the environment's instructions, in the template's system turn (so in the head, before
    any privileged context); a template without a system role gets them at the start of the first
    user turn instead.

    -> token ids of each piece; eot is the token that ends an assistant turn (the first of its close),
    what the agent generates last and decoding stops on. Every turn opens with the generation prompt,
    as it did when the agent generated it (a template may render past assistant turns otherwise, e.g.
    Qwen3's without their empty <think></think>: the body holds what the policy was conditioned on).
    Thinking is switched off (enable_thinking=False, for templates that read it): an action is a few
    dozen tokens. Template text is tokenized with its special tokens."""
    mk = ['\x01T1\x01', '\x01A1\x01', '\x01T2\x01']
    user = lambda t: {'role': 'user', 'content': t}
    render = lambda msgs: hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    sys_turn, in_user = [], ''
    if system:
        try:
            ok = system in render([{'role': 'system', 'content': system}, user(mk[0])])
        except Exception:  # a template that rejects a system turn
            ok = False
        sys_turn, in_user = ([{'role': 'system', 'content': system}], '') if ok else ([], system + '\n\n')
    try:
        head, asst = render(sys_turn + [user(mk[0])]).split(mk[0])
        head3, rest = render(sys_turn + [user(mk[0]), {'role': 'assistant', 'content': mk[1]}, user(mk[2])]).split(mk[0])
        close, asst3 = rest.split(mk[1])[1].split(mk[2])
    except Exception as e:
        raise ValueError(f'cannot read the chat template\'s turns: {type(e).__name__}: {e}') from e
    enc = lambda t: hf.encode(t, add_special_tokens=False)
    close_ids = enc(close)
    if head3 != head or asst3 != asst or not close_ids or close_ids[0] not in hf.all_special_ids or not enc(head):
        raise ValueError('the chat template\'s turns are not one fixed layout (head, user, assistant open, '
                         'an end-of-turn special token); use a tokenizer without a chat template')
    eot, eot_text = close_ids[0], hf.decode(close_ids[:1])
    user_open = enc(close[len(eot_text):]) if close.startswith(eot_text) else close_ids[1:]
    return {'head': tuple(enc(head + in_user)), 'user': tuple(user_open), 'assistant': tuple(enc(asst)), 'eot': eot}


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


def byte_tokenizer(ranks=None):
    """A tiktoken Encoding built offline: every byte is a token, plus the BPE merges of ranks
    (bpe_ranks; None: plain bytes), plus the turn-structure specials."""
    ranks = ranks or {bytes([i]): i for i in range(256)}
    enc = tiktoken.Encoding(
        name=f'bpe{len(ranks) - 256}+turns',
        pat_str=PAT,
        mergeable_ranks=ranks,
        special_tokens={s: len(ranks) + i for i, s in enumerate(SPECIALS)},
    )
    return Tokenizer(enc=enc)
