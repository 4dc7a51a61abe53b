"""The model behind one small interface, and the token-level helpers on top of it.

The algorithm (lopd.py, retrieval.py, train.py) only needs: a tokenizer (tokenizer.py: encode/decode
and the turn layout), the embedding matrix (to build `inputs_embeds`), and a causal LM that accepts
`inputs_embeds`. Two ways to get them (`load`):

- default: a small BPE `tiktoken.Encoding` trained offline on the text the model will read
  (`tokenizer.byte_tokenizer`; it cuts every sequence about 3x against bytes) and a tiny Llama
  built from a `transformers` config with random weights. Nothing is downloaded.
  `--bpe_merges 0` keeps plain bytes.
- `--model NAME_OR_PATH`: any `transformers` causal LM and its tokenizer (its chat template's
  turns, or the special tokens added to its vocabulary and the embedding matrix resized).

On top of that interface: LoRA and the frozen θ0 (`with_lora`, `Adapter`), an episode as tokens
and its agent-token mask (`encode_episode`), right-padded batches (`pad_batch`), the two kinds of
context prefix (`bos_prefix` for the student, `text_prefix` for a teacher told something in
words), KV-cached decoding of one agent turn (`generate`) and scoring every prefix of a batch in
one forward (`logits_on`).
"""
import contextlib
import functools
import inspect
import os
import re
import warnings

import torch
from torch.utils.checkpoint import checkpoint

import lopd
from tokenizer import Tokenizer, byte_tokenizer


def tiny_llama(vocab_size, d_model=128, n_layer=4, n_head=4, max_len=512):
    """A ~0.9M-parameter Llama with random weights (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM  # imported here: `train.py -h` stays fast
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=d_model, intermediate_size=3 * d_model,
                      num_hidden_layers=n_layer, num_attention_heads=n_head, num_key_value_heads=n_head,
                      max_position_embeddings=max_len, tie_word_embeddings=True,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(cfg)


def load(model_name=None, d_model=128, n_layer=4, ranks=None, dtype=torch.float32, system=None):
    """-> (tokenizer, model). model_name None = the offline tokenizer (bytes + the BPE merges `ranks`
    of tokenizer.bpe_ranks, or bytes alone) + tiny Llama. A transformers model (a hub name, a folder, or a .gguf file, whose
    quantized weights transformers dequantizes) is loaded in `dtype` (bf16 halves its memory);
    system: the instructions its chat template's system turn carries."""
    if model_name is None:
        tok = byte_tokenizer(ranks)
        return tok, tiny_llama(tok.vocab_size, d_model, n_layer)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    where, kw = model_name, {}
    if model_name.endswith('.gguf'):
        where, kw = os.path.dirname(os.path.abspath(model_name)), {'gguf_file': os.path.basename(model_name)}
    tok = Tokenizer(hf=AutoTokenizer.from_pretrained(where, **kw), system=system)
    # use_kernels=False: transformers >= 5.2x swaps layers for kernels from the Hub on CUDA by default,
    # code fetched at run time and refused without trust_remote_code (seen on an H200: no step ran)
    model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, use_kernels=False, **kw)
    if kw:  # the weights are plain dequantized tensors now: drop the mark that forbids saving them (--export)
        model.hf_quantizer = None
        model.config.__dict__.pop('quantization_config', None)
    if model.get_input_embeddings().weight.shape[0] < tok.vocab_size:
        model.resize_token_embeddings(tok.vocab_size)
    return tok, model


def blocks(model):
    """The decoder blocks of a transformers causal LM (Llama, Qwen: .layers; GPT-2: .h)."""
    dec = model.get_decoder()
    return dec.layers if hasattr(dec, 'layers') else dec.h


# ----------------------------------------------------------------------------- LoRA (peft)

def with_lora(model, tok, r):
    """θ = θ0 + a rank-r LoRA adapter on every linear layer (Hu et al. 2021, via peft), with α = 2r.
    Turn specials added to a vocabulary (a tokenizer without a chat template) are new, untrained
    rows of the embedding: they train too, as rows (peft's trainable tokens). -> the peft model."""
    from peft import LoraConfig, get_peft_model
    new = [tok.bos, tok.obs, tok.agent, tok.eot, tok.ctx, tok.pad] if tok.hf is not None and not tok.chat else None
    cfg = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules='all-linear', trainable_token_indices=new)
    with warnings.catch_warnings():  # peft's own use of a renamed transformers property; GPT-2's Conv1D, which it handles
        warnings.filterwarnings('ignore', message='.*is_gradient_checkpointing.*|.*fan_in_fan_out.*')
        return get_peft_model(model, cfg)


def checkpoint_activations(model):
    """Gradient checkpointing (non-reentrant), which transformers applies in training mode only,
    i.e. inside `train_mode`: rollouts, evaluation and the teachers run in eval mode."""
    kw = {'use_reentrant': False}
    if hasattr(model, 'activation_checkpointing_enable'):  # its name since transformers 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    return model


@contextlib.contextmanager
def layers_checkpointed(model):
    """--grad_ckpt where nothing trains θ: transformers checkpoints a layer only in training mode, so a
    frozen teacher holding φ's graph (steps 4 and 6, the cold start) would keep every layer's activations.
    Marks the checkpointed layers alone as training for one forward: their children (dropout, attention)
    stay in eval mode, so the numbers are eval mode's. No --grad_ckpt, or no graph: nothing changes."""
    net = model.peft if isinstance(model, Adapter) else model
    layers = [m for m in net.modules() if getattr(m, 'gradient_checkpointing', False) and not m.training] \
        if torch.is_grad_enabled() else []
    funcs = [m._gradient_checkpointing_func for m in layers]
    for m in layers:
        m.training = True
        if isinstance(model, Adapter):  # the backward recomputes a layer outside the call: with the teacher's adapter again
            m._gradient_checkpointing_func = functools.partial(
                checkpoint, use_reentrant=False, context_fn=lambda: (contextlib.nullcontext(), model.active()))
    try:
        yield model
    finally:
        for m, f in zip(layers, funcs):
            m.training, m._gradient_checkpointing_func = False, f


@contextlib.contextmanager
def train_mode(model):
    """Training mode while θ takes its step (dropout, where a config has it, and --grad_ckpt act
    only then); eval mode again after, for rollouts, evaluation and the teachers, which share θ's model."""
    model.train()
    try:
        yield model
    finally:
        model.eval()


def is_lora(model):
    return hasattr(model, 'peft_config')


def merged(model):
    """The plain transformers model with every adapter folded into its weights (θ0 after a LoRA
    warm-up; the student at export)."""
    if not is_lora(model):
        return model
    for name in [n for n in model.peft_config if n != 'default']:
        model.delete_adapter(name)
    return model.merge_and_unload()


@contextlib.contextmanager
def lora_merged(model, on=True):
    """θ's LoRA folded into its weights while it decodes (--merge_lora): a decoding step then runs one matmul per
    linear layer instead of the LoRA's three and its adds, which is what bounds it on a GPU (one launch per op). The
    base weights are saved first and copied back after, never un-merged (W + BA − BA is not W in floats), so θ0 and
    the adapter train on exactly as before. The merged weights have the base's dtype: in bf16 BA is rounded there, and
    the decoded policy differs from the scored one by that rounding (float32: token-identical in the tests)."""
    if not on or not is_lora(model) or isinstance(model, Adapter):
        yield model
        return
    from peft.tuners.tuners_utils import BaseTunerLayer
    saved = [(m, m.get_base_layer().weight.detach().clone()) for m in model.modules() if isinstance(m, BaseTunerLayer)]
    model.merge_adapter()
    try:
        yield model
    finally:
        model.unmerge_adapter()                                                 # peft's bookkeeping: nothing merged
        with torch.no_grad():
            for m, w in saved:
                m.get_base_layer().weight.copy_(w)                              # the base, bit for bit


def trainable_state(model):
    """What trains, as a state dict: the LoRA adapter (and trained token rows), or every weight."""
    if not is_lora(model):
        return model.state_dict()
    from peft import get_peft_model_state_dict
    return get_peft_model_state_dict(model)


def load_trainable(model, saved):
    """Inverse of trainable_state; names or shapes that differ raise."""
    if not is_lora(model):
        return model.load_state_dict(saved)
    Adapter(model, 'default').load_state_dict(saved)


class Adapter:
    """One set of weights of the student's peft model, used wherever a model is: θ0 (name None:
    the adapter off) or a named adapter (the EMA teacher). Every base weight is θ's own, so a
    teacher costs no copy of the model. While it runs, `on` is True (ACSD steers only then)."""

    def __init__(self, peft, name=None):
        self.peft, self.name, self.on, self._params = peft, name, False, None

    @contextlib.contextmanager
    def active(self):
        with contextlib.ExitStack() as stack:
            if self.name is None:
                stack.enter_context(self.peft.disable_adapter())
            else:
                self.peft.set_adapter(self.name)  # peft also flips requires_grad: θ's adapter is frozen meanwhile,
                stack.callback(self.peft.set_adapter, 'default')
                for p in self.parameters():       # and this one made trainable: a teacher builds no graph
                    p.requires_grad_(False)
            self.on = True
            stack.callback(setattr, self, 'on', False)
            yield

    def __call__(self, *args, **kw):
        with self.active():
            return self.peft(*args, **kw)

    def get_decoder(self):
        return _Under(self, self.peft.get_decoder())

    def get_input_embeddings(self):  # θ0 reads the turn specials' rows as they were, not as θ trains them
        return _Under(self, self.peft.get_input_embeddings())

    def get_output_embeddings(self):
        return _Under(self, self.peft.get_output_embeddings())

    def __getattr__(self, k):  # embeddings, head, config, device: θ's own
        return getattr(self.peft, k)

    def parameters(self):
        """This adapter's tensors, in the order of the modules (paired with θ's by lopd.ema_update);
        looked up once (every switch to the EMA teacher reads them)."""
        if self._params is None:
            pat = re.compile(rf'\.{re.escape(self.name)}(\.|$)')
            self._params = [p for n, p in self.peft.named_parameters() if pat.search(n)]
        return self._params

    def state_dict(self):
        from peft import get_peft_model_state_dict
        return get_peft_model_state_dict(self.peft, adapter_name=self.name)

    def load_state_dict(self, saved):
        from peft import set_peft_model_state_dict
        mine = self.state_dict()
        bad = sorted(set(mine) ^ set(saved)) or [k for k in mine if mine[k].shape != saved[k].shape]
        if bad:
            raise ValueError(f'size mismatch for adapter {self.name}: {bad[0]}')
        set_peft_model_state_dict(self.peft, saved, adapter_name=self.name)


class _Under:
    """A submodule of the peft model called under an Adapter (its decoder, for chunked scoring)."""

    def __init__(self, adapter, module):
        self.adapter, self.module = adapter, module

    def __call__(self, *args, **kw):
        with self.adapter.active():
            return self.module(*args, **kw)

    def __getattr__(self, k):
        return getattr(self.module, k)


def add_ema(model):
    """A second adapter 'ema' on the student's peft model, equal to θ's adapter -> its Adapter view."""
    model.add_adapter('ema', model.peft_config['default'])
    model.set_adapter('default')  # θ's adapter stays the trainable one; 'ema' is frozen
    ema = Adapter(model, 'ema')
    with torch.no_grad():
        for pt, ps in zip(ema.parameters(), Adapter(model, 'default').parameters()):
            pt.copy_(ps)
    return ema


def trained(model):
    """The weights the optimizer moves: the adapter with LoRA, else the model (for lopd.ema_update)."""
    return Adapter(model, 'default') if is_lora(model) else model


def embed(model, ids):
    """Token ids (any shape) -> the model's input embeddings (…, d)."""
    return model.get_input_embeddings()(ids)


def hidden(model, ids, mask, rows=0):
    """Last-layer hidden states of token ids (B, L) with right padding -> (B, L, d), `rows` rows a forward (0: all).
    The LM head runs on the last position only: every position's logits, unused here, are B × L × V floats (GiBs at
    V = 151,936 for an evaluation's 100 rows)."""
    if 0 < rows < ids.shape[0]:
        return torch.cat([hidden(model, ids[i:i + rows], mask[i:i + rows]) for i in range(0, ids.shape[0], rows)])
    kw = {'logits_to_keep': 1} if KEEP_KW[type(base_of(model))] else {}
    with layers_checkpointed(model):                                            # a trained reader's graph (--grad_ckpt)
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False, **kw)   # nothing decodes
    return out.hidden_states[-1]


def forward(model, embeds, mask, past=None, pos=None, use_cache=False, last_only=False):
    """One causal forward from `inputs_embeds`. embeds (B, L, d), mask (B, L_total) 1 = real.

    Position ids follow the mask (left padding gets no positions), so a row's logits do
    not depend on how much padding the batch put in front of it. last_only: the logits of the
    last position only, (B, 1, V) (a prefill reads no other: at V = 151,936 the rest is GBs).
    -> (logits, cache)."""
    if pos is None:
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -embeds.shape[1]:]  # (B, L)
    kw = {CACHE_KW[type(base_of(model))]: past} if past is not None else {}
    if last_only and KEEP_KW[type(base_of(model))]:
        kw['logits_to_keep'] = 1
    out = model(inputs_embeds=embeds, attention_mask=mask, position_ids=pos, use_cache=use_cache, **kw)
    cache = (out['cache'] if 'cache' in out else out.get('past_key_values')) if use_cache else None
    return out.logits, cache


def base_of(model):
    """The transformers model under an Adapter view or a peft wrapper (whose forward passes keywords on)."""
    model = model.peft if isinstance(model, Adapter) else model
    return model.get_base_model() if is_lora(model) else model


class _CacheKw(dict):
    """transformers 5.x renamed `past_key_values` to `cache`; look the name up once per class."""
    def __missing__(self, cls):
        self[cls] = 'cache' if 'cache' in inspect.signature(cls.forward).parameters else 'past_key_values'
        return self[cls]


CACHE_KW = _CacheKw()


class _KeepKw(dict):
    """Whether a class's forward takes `logits_to_keep` (every recent transformers causal LM does)."""
    def __missing__(self, cls):
        self[cls] = 'logits_to_keep' in inspect.signature(cls.forward).parameters
        return self[cls]


KEEP_KW = _KeepKw()


# ----------------------------------------------------------------------------- tokens of an episode

def obs_ids(tok, text, first=False):
    return tok.turn(text, first)


def encode_episode(tok, ep):
    """An episode as the student sees it (after its head) and its agent-token mask.

    <|obs|> task <|agent|> a1 <|eot|> <|obs|> o1 <|agent|> a2 <|eot|> ...   (or the chat template's turns)
    mask = 1 on action tokens and their <|eot|> (what the agent generated), 0 elsewhere."""
    ids = obs_ids(tok, ep.task.prompt, first=True)
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
    T, cpu = max(len(s) for s in seqs), 'cpu'                                   # built on the host, then one copy each
    ids = torch.full((len(seqs), T), pad, dtype=torch.long, device=cpu)
    amask = torch.zeros(len(seqs), T, device=cpu)
    attn = torch.zeros(len(seqs), T, dtype=torch.long, device=cpu)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        ids[i, :len(s)], amask[i, :len(s)] = torch.tensor(s, device=cpu), torch.tensor(m, dtype=torch.float, device=cpu)
        attn[i, :len(s)] = 1
    return ids.to(device), amask.to(device), attn.to(device)


# ----------------------------------------------------------------------------- contexts, decoding, scoring

def bos_prefix(model, tok, n):
    """The student's 'context': just <|bos|> (or the chat template's head), as (P, d) embeddings per row."""
    return [embed(model, torch.tensor(tok.head(), device=model.device))] * n


def text_prefix(model, tok, texts):
    """<|bos|><|ctx|> text, embedded by the teacher: a privileged context given as text."""
    return [embed(model, torch.tensor(tok.context_head() + tok.encode(t), device=model.device)) for t in texts]


class Turns:
    """The KV cache of a batch of conversations, kept across their turns (rollout passes one per
    episode batch): each turn reads only what is new since the agent's last token (a cut turn's
    <|eot|>, the observation), not the system prompt and the earlier turns again.
    rows: which conversations the cache holds; fed: body tokens of each already in it."""

    def __init__(self):
        self.cache, self.mask, self.rows, self.fed = None, None, [], []


@torch.no_grad()
def filtered(logits, top_k=0, top_p=1.0):
    """Logits with every token outside the top_k, then outside the top_p nucleus (the fewest tokens whose mass
    reaches p; the first always kept), at −inf: transformers' order. top_k 0 and top_p 1: the logits unchanged."""
    if top_k:
        logits = logits.masked_fill(logits < logits.topk(min(top_k, logits.shape[-1]), -1).values[..., -1:], float('-inf'))
    if top_p < 1:
        p, idx = logits.softmax(-1).sort(-1, descending=True)
        drop = p.cumsum(-1) - p >= top_p                                        # the mass before it already reaches p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, idx, drop), float('-inf'))
    return logits


def generate(model, tok, prefixes, bodies, max_new, greedy, temperature=1.0, turns=None, rows=None, top_k=0, top_p=1.0):
    """Sample one agent turn per row (at `temperature`, or greedy), with a KV cache, until <|eot|> or max_new tokens.

    prefixes: list of (P_i, d) context embeddings; bodies: list of token lists. Rows are left-padded
    so that every row's next token is at the last position (padding gets no position: a row's
    tokens do not depend on the batch). turns (a Turns) and rows (which conversations these are):
    the cache of their earlier turns, whose bodies only grew since; a conversation left out is
    dropped from it."""
    if turns is not None and turns.cache is not None:                           # a later turn: only the new tokens
        at = [turns.rows.index(r) for r in rows]
        if len(at) < len(turns.rows):                                           # episodes that ended leave the batch
            turns.cache.batch_select_indices(torch.tensor(at, device=model.device))
        fed = [turns.fed[k] for k in at]
        new = [embed(model, torch.tensor(b[n:], device=model.device)) for b, n in zip(bodies, fed)]
        past, before = turns.cache, turns.mask[at]
    else:
        new = [torch.cat([p, embed(model, torch.tensor(b, device=model.device))]) for p, b in zip(prefixes, bodies)]
        past, before = None, None
    assert all(r.shape[0] for r in new), 'a later turn must add tokens'
    L, B = max(r.shape[0] for r in new), len(new)
    E = new[0].new_zeros(B, L, new[0].shape[1])
    mask = torch.zeros(B, L, dtype=torch.long, device=model.device)
    for i, r in enumerate(new):
        E[i, L - r.shape[0]:], mask[i, L - r.shape[0]:] = r, 1
    mask = mask if before is None else torch.cat([before, mask], 1)
    logits, cache = forward(model, E, mask, past=past, use_cache=True, last_only=True)
    start = mask.shape[1]                                                       # the columns this turn's tokens fill
    pos = mask.sum(-1, keepdim=True) - 1                                        # (B, 1) position of the last token
    done = torch.zeros(B, dtype=torch.bool, device=model.device)
    steps = []                                                                  # (B,) tokens, -1 once a row is done
    for _ in range(max_new):
        last = logits[:, -1].float()                                            # (B, V)
        nxt = last.argmax(-1) if greedy else \
            torch.multinomial(torch.softmax(filtered(last / temperature, top_k, top_p), -1), 1).squeeze(-1)
        steps.append(torch.where(done, -1, nxt))
        was, done = done, done | (nxt == tok.eot)
        if bool(done.all()):                                                    # the one host sync of a step
            break
        mask, pos = torch.cat([mask, (~was).long()[:, None]], 1), pos + 1      # a finished row's tokens: masked out
        logits, cache = forward(model, embed(model, nxt[:, None]), mask, past=cache, pos=pos, use_cache=True)
    rows_out = torch.stack(steps, 1).tolist() if steps else [[] for _ in range(B)]  # (B, steps), read once at the end
    if turns is not None:  # the body tokens now in the cache: what was fed before, the new piece, the tokens fed since
        turns.cache, turns.mask, turns.rows = cache, mask, list(rows if rows is not None else range(B))
        turns.fed = [len(b) + int(k) for b, k in zip(bodies, mask[:, start:].sum(-1).tolist())]
    return [[t for t in row if t >= 0] for row in rows_out]


def logits_on(model, prefixes, ids, attn, chunk=0, rows=0):
    """Score every prefix of the trajectories in one forward: (B, T, V), where row i,
    position t is π(· | context_i, body_i[:t]), i.e. the distribution of body token t.

    chunk > 0 (a run's --score_chunk): a lopd.Logits, the last hidden states and the LM head, that
    the losses read `chunk` positions at a time, so that (B, T, V) is never held for the batch.
    Under autocast (bf16) the head runs in float32 either way: the log-probs are of float32 logits.
    rows > 0 (--micro_batch): the model's body runs `rows` rows at a time and, with a graph, each
    piece's activations are recomputed in the backward (activation checkpointing), one piece at a
    time: the loss still sees the whole batch, so any loss gets the same gradient."""
    lazy = chunk > 0 or torch.is_autocast_enabled(ids.device.type)              # else (B, T, V) from the model's own head
    T = ids.shape[1]

    def body(prefixes, ids, attn):  # -> (b, T, d) last hidden states, or (b, T, V) logits
        E, mask, P = lopd.teacher_inputs(prefixes, embed(model, ids), attn)
        with layers_checkpointed(model):                                        # --grad_ckpt: per layer, θ's or a teacher's
            if not lazy:
                return forward(model, E, mask)[0][:, P - 1:P - 1 + T]
            pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
            return model.get_decoder()(inputs_embeds=E, attention_mask=mask, position_ids=pos,
                                       use_cache=False).last_hidden_state[:, P - 1:P - 1 + T]

    if 0 < rows < ids.shape[0]:
        piece = lambda i: body(prefixes[i:i + rows], ids[i:i + rows], attn[i:i + rows])
        h = torch.cat([checkpoint(piece, i, use_reentrant=False) if torch.is_grad_enabled() else piece(i)
                       for i in range(0, ids.shape[0], rows)])
    else:
        h = body(prefixes, ids, attn)
    if not lazy:
        return h
    out = lopd.Logits(h, *head_weights(model), max(chunk, 0), getattr(model.config, 'final_logit_softcapping', None))
    if chunk <= 0:  # under autocast, unchunked: the whole (B, T, V) at once, its head in float32
        return out.head(out.h.reshape(-1, out.h.shape[-1])).view(out.shape)
    return out if torch.is_grad_enabled() else out.detach()   # no graph: the head as it is now


def head_weights(model):
    """The LM head as (weight (V, d), bias or None), as the model's forward applies it. A plain
    Linear gives its own; a wrapped head (peft's trainable rows of the turn specials on a head tied
    to the embedding, which has no weight of its own) is read through its forward: head(I) − head(0)."""
    head = model.get_output_embeddings()
    plain = head.module if isinstance(head, _Under) else head
    if type(plain) is torch.nn.Linear:  # LoRA's all-linear leaves the output layer alone: θ0's and θ's are one
        return plain.weight, plain.bias
    w = plain.weight if hasattr(plain, 'weight') else model.get_input_embeddings().weight
    eye = torch.eye(w.shape[1], dtype=w.dtype, device=w.device)
    zero = head(eye.new_zeros(1, w.shape[1]))                                    # (1, V): the bias, if any
    return (head(eye) - zero).T, (zero[0] if zero.abs().max() > 0 else None)


def export(model, tok, path):
    """The student as a plain transformers model, LoRA merged, that AutoModelForCausalLM.from_pretrained
    reads back, with its tokenizer (the tiny model's tiktoken vocabulary has no such form). -> path."""
    merged(model).save_pretrained(path)
    if tok.hf is not None:
        tok.hf.save_pretrained(path)
    return path
