"""The math of on-policy self-distillation and of LOPD, as pure functions.

    token_logp        log π(y_t | y<t) of the sampled tokens
    divergence        per-token D(student ‖ teacher): reverse KL, forward KL, generalized JSD
    topk_divergence   the same over the teacher's top-k tokens plus one "tail" bucket
    distill_loss      L_distill = Σ_{t∈A} D(π_θ ‖ sg π_T) / |A|
    Composer, QFormer retrieved experiences -> K latent tokens each (an MLP on segment means; learned queries)
    teacher_inputs    [context (text or latents) ; trajectory] as one left-padded inputs_embeds batch
    privileged_margin Δ(φ) = mean_τ w(τ)·mean_{t∈A} δ_t,  δ_t = log π_T(y_t) − sg log π_θ(y_t),  w = 2r − 1
    composer_kl, anchor  eq. (3)'s first and last terms: KL(sg π_θ ‖ π_T^φ), ‖z − sg z_0‖²
    composer_loss     KL(sg π_θ ‖ π_T^φ) + β(m − Δ) + λ‖z − sg z_0‖² in one call (the step's reference)
    dual_update       β ← max(0, β + η_β (m − Δ))
    group_advantage   GRPO's (r − mean)/std over a group of G rollouts of one task
    ppo_clip_loss     PPO-clip policy gradient, token mean
    is_k3_loss        Skill-SD's importance-weighted sampled-token reverse KL (k3 estimator)
    ema_update        θ_T ← (1 − rate) θ_T + rate θ (SDPO's teacher)
    Logits            (B, T, V) logits kept as the last hidden states and the LM head, read in chunks

Shapes: B rollouts, T tokens, V vocabulary, d model width, K latents per experience,
J experiences per task. `mask` is the agent-token mask A: 1 on tokens the agent
generated, 0 on prompt, observation and padding tokens. Nothing here does I/O or keeps
state; train.py owns the models and the loop (LOPD's step is train.lopd_step), plugins/ the baselines.

References: LOPD, Zhang et al. 2026 (arXiv 2608.13040): the distillation loss, the composer,
the privileged margin and its dual update; GKD, Agarwal et al. 2024 (generalized JSD);
GRPO, Shao et al. 2024; PPO, Schulman et al. 2017; Skill-SD, Wang et al. 2026 (the
importance-weighted k3 term); k3, Schulman 2020 ("Approximating KL divergence").
"""
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _f32(x):
    """At least float32 (bf16 logits would round the log-probs), float64 stays float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def token_logp(logits, y, where=None):
    """log π(y_t) for the sampled tokens. logits (B, T, V), y (B, T) -> (B, T) (`where`: per_position's)."""
    return per_position(lambda l, y: torch.gather(F.log_softmax(_f32(l), -1), -1, y.unsqueeze(-1)).squeeze(-1), logits, y,
                        where=where)


def masked_mean(x, mask):
    """Mean of x over the positions where mask is 1 (0 if there are none)."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1)


def _kl(logp, logq):
    """KL(p ‖ q) = Σ_v p (log p − log q) over the last dim; 0·log 0 counts as 0."""
    p = logp.exp()
    return (p * (logp - logq)).masked_fill(p == 0, 0.0).sum(-1)


def divergence_from_logp(logp_s, logp_t, kind='rkl', beta=0.5):
    """Per-position divergence between two (…, V) log-distributions -> (…).

    rkl: KL(student ‖ teacher), mode-seeking: the student is punished for mass where the
         teacher has none (LOPD's and SDPO's; OPSD and SDFT use fkl as the LOPD paper ran them).
    fkl: KL(teacher ‖ student), mass-covering.
    jsd: generalized JSD(β) = β KL(T ‖ M) + (1−β) KL(S ‖ M), M = β T + (1−β) S
         (Agarwal et al. 2024, GKD; OPSD uses β = 0.5, the symmetric JSD). At β = 0 and 1 the
         formula is 0 for any pair; its limits, JSD/β -> KL(T ‖ S) and JSD/(1−β) -> KL(S ‖ T),
         are what β = 0 and β = 1 give here, as in GKD's code.
    """
    if kind == 'rkl' or (kind == 'jsd' and beta == 1):
        return _kl(logp_s, logp_t)
    if kind == 'fkl' or (kind == 'jsd' and beta == 0):
        return _kl(logp_t, logp_s)
    if kind == 'jsd':
        if not 0 < beta < 1:
            raise ValueError(f'jsd needs 0 <= beta <= 1, got {beta}')
        # log M computed in log space: log(β e^{log T} + (1−β) e^{log S})
        w = lambda x: torch.log(torch.tensor(x, dtype=logp_t.dtype, device=logp_t.device))  # in the inputs' precision
        logm = torch.logsumexp(torch.stack([logp_t + w(beta), logp_s + w(1 - beta)]), 0)
        return beta * _kl(logp_t, logm) + (1 - beta) * _kl(logp_s, logm)
    raise ValueError(f'unknown divergence {kind!r}')


def divergence(logits_s, logits_t, kind='rkl', beta=0.5, where=None):
    """Full-vocabulary per-token divergence. logits (B, T, V) -> (B, T) (`where`: per_position's)."""
    return per_position(lambda s, t: divergence_from_logp(F.log_softmax(_f32(s), -1), F.log_softmax(_f32(t), -1), kind, beta),
                        logits_s, logits_t, where=where)


def entropy(logits):
    """H(π) = −Σ_v π log π per position. (N, V) logits -> (N,), float32 (lopd.per_position maps it over (B, T))."""
    logp = F.log_softmax(_f32(logits), -1)
    return -_kl(logp, torch.zeros_like(logp))                                  # Σ π (log π − 0), 0·log 0 = 0


def mean_entropy(logits, mask):
    """H(π) averaged over the masked (agent) positions, the head run only there (a logged diagnostic)."""
    return masked_mean(per_position(entropy, logits, where=mask), mask)


def _with_tail(topk_logp):
    """Append the tail bucket log(1 − Σ_topk p). (…, k) -> (…, k+1).

    The clamp keeps log(0) finite when the top-k hold all the mass (k = V); the tail then
    has ~1e-7 mass on both sides and contributes ~0 to the divergence."""
    log_top = torch.logsumexp(topk_logp, -1, keepdim=True).clamp(max=-1e-7)
    return torch.cat([topk_logp, torch.log(-torch.expm1(log_top))], -1)


def topk_divergence(logits_s, logits_t, k, kind='rkl', beta=0.5, where=None):
    """Divergence over the teacher's top-k tokens + one tail bucket, for big vocabularies.

    Both distributions are read at the *teacher's* top-k ids, so the buckets match.
    With k = V it equals the full-vocabulary divergence. logits (B, T, V) -> (B, T)."""
    def f(logits_s, logits_t):
        logp_s, logp_t = F.log_softmax(_f32(logits_s), -1), F.log_softmax(_f32(logits_t), -1)
        idx = logp_t.topk(min(k, logp_t.shape[-1]), -1).indices   # (…, k)
        s = _with_tail(torch.gather(logp_s, -1, idx))              # (…, k+1)
        t = _with_tail(torch.gather(logp_t, -1, idx))              # (…, k+1)
        return divergence_from_logp(s, t, kind, beta)
    return per_position(f, logits_s, logits_t, where=where)


def distill_loss(logits_s, logits_t, mask, kind='rkl', topk=0, beta=0.5):
    """L_distill = Σ_{t∈A} D(π_θ(·|x,y<t) ‖ sg π_T(·|c,x,y<t)) / |A|   (the LOPD paper's student loss;
    OPSD, SDPO, SDFT differ in D and in what the teacher's context c holds).

    One forward pass per role already scored every prefix (causal attention), so this
    is a masked mean over positions. The teacher is detached: gradients reach θ only."""
    logits_t = logits_t.detach()
    d = topk_divergence(logits_s, logits_t, topk, kind, beta, mask) if topk else divergence(logits_s, logits_t, kind, beta, mask)
    return masked_mean(d, mask)


# ----------------------------------------------------------------------------- LOPD composer

class Composer(nn.Module):
    """φ: one retrieved experience, as read by the frozen base model, -> K latent tokens.

    The frozen model's hidden states h (N, L, d) over "task to solve: x / reference past
    trajectory: m_j" are mean-pooled into K contiguous segments, then an MLP (d -> 2d -> d)
    maps each pooled vector into the model's input-embedding space: each latent summarises its
    own slice of the experience (--composer mlp); the paper's composer is a Q-Former with learned
    queries (QFormer below).
    """

    def __init__(self, d, K, scale=0.05):
        super().__init__()
        self.K = K
        self.mlp = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        # start the latents at the scale of token embeddings (scale ~ their std): large
        # random vectors in the teacher's prompt would swamp its attention at step 0
        with torch.no_grad():
            nn.init.normal_(self.mlp[-1].weight, std=scale / (2 * d) ** 0.5)
            self.mlp[-1].bias.zero_()

    def forward(self, h, mask):
        """h (N, L, d), mask (N, L) -> z (N, K, d)."""
        return self.from_reading(segment_pool(h, mask, self.K))

    def read(self, h, e, mask):
        """What φ keeps of a reading: h (N, L, d) over mask (N, L); e (the token embeddings) unused."""
        return segment_pool(h, mask, self.K)

    def shown(self, n):
        """How many of an experience's K latents the teacher is shown, for an experience of n tokens: all."""
        return self.K

    def from_reading(self, pooled):
        """The MLP alone, on readings already pooled into K segments: (N, K, d) -> z (N, K, d).
        A frozen reading does not change, so it can be pooled once and reused (retrieval.cold_start)."""
        return self.mlp(pooled)


class QFormer(nn.Module):
    """φ as the paper's Q-Former: K learned queries cross-attend over the reader's states of one
    experience. Keys come from the reader's last hidden states (they know what each token *is for*:
    the tool's name in a call, an argument); values are the tokens' own input embeddings, plus an
    MLP of the attended states that starts at zero. A query that attends sharply hands the teacher
    one token of the experience exactly as the teacher embeds it: the latents can carry the
    experience's words, which a mean over segments of last-layer states smears away."""

    L = 200  # the longest experience read (reading() cuts each at 200 tokens)

    def __init__(self, d, K, scale=0.05, copy=False):
        super().__init__()
        self.K = K
        self.q = nn.Parameter(torch.randn(K, d) / d ** 0.5)
        self.key = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d))
        # copy: a bias per (query, position) that starts as query k reading token k, so that the first
        # latents are the experience's own embeddings (its text, if K >= its length), then learn
        self.pos = nn.Parameter(10 * torch.eye(K, self.L)) if copy else None
        self.mlp = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        with torch.no_grad():
            self.mlp[-1].weight.zero_()
            self.mlp[-1].bias.zero_()

    def read(self, h, e, mask):
        """Each row's experience tokens, gathered to the front: (N, L, 2d + 1) = [h, e, mask]."""
        N, _, d = h.shape
        out = h.new_zeros(N, self.L, 2 * d + 1)
        for i in range(N):
            idx = mask[i].nonzero().squeeze(-1)[:self.L]
            out[i, :len(idx)] = torch.cat([h[i, idx], e[i, idx], h.new_ones(len(idx), 1)], -1)
        return out

    def shown(self, n):
        """How many of an experience's K latents the teacher is shown, for an experience of n tokens: with
        the copy, the first min(K, n), since query k > n would start on no token (a mean of them all, a
        vector the base never read); the plain Q-Former's queries are not positions: all K."""
        return min(self.K, n) if self.pos is not None else self.K

    def from_reading(self, read):
        """(N, L, 2d + 1) -> z (N, K, d)."""
        d = (read.shape[-1] - 1) // 2
        h, e, mask = read[..., :d], read[..., d:2 * d], read[..., -1]
        scores = torch.einsum('kd,nld->nkl', self.q, self.key(h)) / d ** 0.5    # (N, K, L)
        if self.pos is not None:
            scores = scores + self.pos[:, :scores.shape[-1]]
        a = scores.masked_fill(mask[:, None] == 0, float('-inf')).softmax(-1)
        return torch.einsum('nkl,nld->nkd', a, e) + self.mlp(torch.einsum('nkl,nld->nkd', a, h))


COMPOSERS = {'mlp': Composer, 'qformer': QFormer, 'qformer-copy': functools.partial(QFormer, copy=True)}


def segment_pool(h, mask, K):
    """Mean of h over K contiguous, near-equal segments of each row's real tokens.

    e.g. 6 real tokens, K = 3 -> segments {0,1} {2,3} {4,5}. h (N, L, d), mask (N, L) -> (N, K, d)."""
    mask = mask.to(h.dtype)
    n = mask.sum(-1, keepdim=True).clamp(min=1)                                # (N, 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)                                   # (N, L) index among real tokens
    seg = torch.div(pos * K, n, rounding_mode='floor').long().clamp(max=K - 1)  # (N, L)
    w = F.one_hot(seg, K).to(h.dtype) * mask.unsqueeze(-1)                     # (N, L, K)
    w = w / w.sum(1, keepdim=True).clamp(min=1)                                # average within a segment
    return torch.einsum('nlk,nld->nkd', w, h)                                  # (N, K, d)


def teacher_inputs(prefixes, body, body_mask):
    """Put each row's privileged context in front of its trajectory, as inputs_embeds.

    prefixes: list of B tensors (P_i, d) — the context for row i: embedded framing text
      with latent tokens z spliced in (LOPD), or an embedded text context (OPSD, ...).
    body: (B, T, d) embedded trajectory, body_mask (B, T).
    Prefixes are left-padded to P = max P_i, so every row's trajectory starts at index P:
    the teacher's logits[:, P-1:P-1+T] predict body tokens 0..T-1, exactly as a student
    with a one-token prefix (<|bos|>, P = 1) does with its logits[:, 0:T].
    -> embeds (B, P+T, d), mask (B, P+T), P."""
    B, T, d = body.shape
    P = max(p.shape[0] for p in prefixes)
    pre = body.new_zeros(B, P, d)
    pre_mask = body_mask.new_zeros(B, P)
    for i, p in enumerate(prefixes):
        if p.shape[0]:
            pre[i, P - p.shape[0]:] = p
            pre_mask[i, P - p.shape[0]:] = 1
    return torch.cat([pre, body], 1), torch.cat([pre_mask, body_mask], 1), P


def margin_weight(reward, kind='paper'):
    """w(τ) of the margin (2): paper = 2r − 1; centered = r − mean r over the batch (0 on a batch of equal
    rewards); successes = max(0, 2r − 1), a margin on what succeeded only (a departure: a failure then pushes
    the teacher nowhere). reward graded in [0, 1]. (B,) -> (B,)."""
    return {'paper': lambda: 2 * reward - 1, 'centered': lambda: reward - reward.mean(),
            'successes': lambda: (2 * reward - 1).clamp(min=0)}[kind]()


def privileged_margin(logp_t, logp_s, mask, w, by_tokens=False):
    """Δ(φ) = mean_τ [ w(τ) · mean_{t∈A} δ_t ],  δ_t = log π_T(y_t|z_φ,…) − sg log π_θ(y_t|…)  (the LOPD paper's
    eq. 2, w = 2r − 1): positive when the latent context makes the teacher more likely than the student on
    successful behaviour and less likely on failures. by_tokens: the rollouts weighted by their agent tokens, not
    equally (what the authors' code moves β on). logp_t, logp_s, mask (B, T); w (B,) -> scalar."""
    m = mask.to(torch.float32)
    n = m.sum(-1).clamp(min=1)                                                  # (B,) agent tokens per rollout
    per_rollout = w.to(torch.float32) * ((logp_t - logp_s.detach()) * m).sum(-1) / n   # (B,) w(τ)·mean_t δ_t
    return (per_rollout * m.sum(-1)).sum() / m.sum().clamp(min=1) if by_tokens else per_rollout.mean()


def composer_kl(logits_s, logits_t, mask):
    """Eq. (3)'s first term, KL(sg π_θ ‖ π_T^φ): each rollout's mean over its own agent tokens, then the mean
    over rollouts (as the authors' code weights it). logits (B, T, V); mask (B, T) -> scalar."""
    m = mask.to(torch.float32)
    return ((divergence(logits_s.detach(), logits_t, 'rkl', where=mask) * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()


def anchor(z, z0, relative=False):
    """Eq. (3)'s ‖z_φ − sg z_φ0‖², as the mean squared entry (so λ does not scale with d·K); relative: divided
    by z0's, so λ does not depend on the latents' scale either. 0 with nothing retrieved. (N, d) -> scalar."""
    if not z.numel():
        return z.new_zeros(())
    out = ((z - z0.detach()) ** 2).mean()
    return out / (z0.detach() ** 2).mean().clamp(min=1e-12) if relative else out


def composer_loss(logits_s, logits_t, y, mask, reward, beta, margin, lam, z, z0, kind='paper', relative=False,
                  kl_weight=1.0):
    """The composer's objective (the LOPD paper's eq. 3) in one call, the reference train.lopd_step's three
    terms are tested against; minimised over φ only:

        KL(sg π_θ ‖ π_T^φ) + β·(m − Δ(φ)) + λ·‖z_φ − sg z_{φ_0}‖²

    The KL keeps the teacher close to the student (stable targets), the margin term makes the latents carry
    reward-relevant information, the anchor keeps them near the cold-start latents. kind: margin_weight's;
    kl_weight scales the KL term (1: the paper's; 0: a diagnostic departure). logits (B, T, V); y, mask (B, T);
    reward (B,); z, z0 (N, d). -> (loss, Δ weighted by tokens for the dual step, ‖z − z0‖²), the last two detached."""
    logits_s, w = logits_s.detach(), margin_weight(reward.to(torch.float32), kind)
    logp_t, logp_s = token_logp(logits_t, y, mask), token_logp(logits_s, y, mask)
    dist = anchor(z, z0, relative)
    loss = kl_weight * composer_kl(logits_s, logits_t, mask) + beta * (margin - privileged_margin(logp_t, logp_s, mask, w)) \
        + lam * dist
    return loss, privileged_margin(logp_t, logp_s, mask, w, by_tokens=True).detach(), dist.detach()


def drift(z, z0):
    """How far φ moved the latents from its cold start: ‖z − z0‖² / ‖z0‖² (mean squared entries; 0 with none)."""
    return ((z.detach() - z0) ** 2).mean() / (z0 ** 2).mean().clamp(min=1e-12) if z.numel() else z.new_zeros(())


def dual_update(beta, margin, delta, eta):
    """β ← max(0, β + η_β (m − Δ)): the multiplier rises while the margin is unmet."""
    return max(0.0, beta + eta * (margin - float(delta)))


# ----------------------------------------------------------------------------- GRPO

def group_advantage(reward, G, eps=1e-4):
    """GRPO advantage (r − mean)/std within each group of G consecutive rollouts of one task.

    e.g. G = 4, r = [1, 0, 0, 0] -> [1.5, -0.5, -0.5, -0.5] (unbiased std = 0.5).
    A group with equal rewards gets 0 everywhere: no signal, as in GRPO. (N,) -> (N,)."""
    r = reward.float().view(-1, G)                                              # (N/G, G)
    std = r.std(-1, keepdim=True) if G > 1 else torch.ones_like(r)
    return ((r - r.mean(-1, keepdim=True)) / (std + eps)).view(-1)


def ppo_clip_loss(logp, logp_old, adv, mask, eps_lo=0.2, eps_hi=0.2):
    """PPO-clip: −mean_{t∈A} min(ρ_t A, clip(ρ_t, 1−ε_lo, 1+ε_hi) A), ρ_t = π_θ(y_t)/π_old(y_t).

    Token mean over every agent token of the batch (DAPO-style), no KL term.
    logp, logp_old, mask (B, T); adv (B,) one per rollout (GRPO), or (B, T) one per token (PPO with a critic) -> scalar."""
    ratio = torch.exp(logp - logp_old.detach())                                 # (B, T)
    A = adv.detach().unsqueeze(-1) if adv.dim() == 1 else adv.detach()         # (B, 1) or (B, T)
    obj = torch.minimum(ratio * A, ratio.clamp(1 - eps_lo, 1 + eps_hi) * A)     # (B, T)
    return -masked_mean(obj, mask)


# ----------------------------------------------------------------------------- Skill-SD, SDPO

def is_k3_loss(logp, logp_old, logp_t, mask):
    """mean_{t∈A} ρ_t·(e^{−ℓ_t} − 1 + ℓ_t),  ℓ_t = log π_θ(y_t) − sg log π_T(y_t),
    ρ_t = π_θ(y_t)/sg π_old(y_t): Skill-SD's sampled-token reverse KL.

    At θ = θ_old (ρ = 1) its gradient is ℓ_t ∇log π_θ(y_t), the score-function gradient of
    KL(π_θ ‖ π_T) estimated on the sampled tokens; e^{−ℓ} − 1 + ℓ ≥ 0 is the k3 estimator.
    logp, logp_old, logp_t, mask (B, T) -> scalar."""
    ell = logp - logp_t.detach()                                                # (B, T)
    rho = torch.exp(logp - logp_old.detach())                                   # (B, T)
    return masked_mean(rho * (torch.exp(-ell) - 1 + ell), mask)


@torch.no_grad()
def ema_update(teacher, student, rate):
    """θ_T ← (1 − rate) θ_T + rate θ, parameter by parameter (SDPO: rate 0.05)."""
    for pt, ps in zip(teacher.parameters(), student.parameters()):
        pt.lerp_(ps, rate)


# ----------------------------------------------------------------------------- scoring in chunks (--model)

class Logits:
    """(B, T, V) logits that are never held whole: the last hidden states h (B, T, d) and the LM
    head, read `chunk` positions at a time by `per_position`. At V = 151,936 one (B, T, V) float32
    tensor of a 4 × 2,048 batch is 5 GB, and a divergence holds several. `detach()` gives the
    teacher's view: no graph, and the head's weight frozen as it was when the teacher scored."""

    def __init__(self, h, weight, bias=None, chunk=256, softcap=None, grad=True):
        self.h, self.weight, self.bias, self.chunk, self.softcap, self.grad = h, weight, bias, chunk, softcap, grad
        self.shape = (*h.shape[:-1], weight.shape[0])

    def detach(self):
        keep = lambda w: None if w is None else w.detach().clone() if w.requires_grad else w.detach()
        return Logits(self.h.detach(), keep(self.weight), keep(self.bias), self.chunk, self.softcap, grad=False)

    def __getitem__(self, rows):  # a subset of rollouts, as a tensor's logits[keep] is
        return Logits(self.h[rows], self.weight, self.bias, self.chunk, self.softcap, self.grad)

    def positions(self, at):  # the flattened positions `at` (N,) of the batch, as one row: (1, N, V)
        return Logits(self.h.reshape(-1, self.h.shape[-1])[at][None], self.weight, self.bias, self.chunk, self.softcap, self.grad)

    def head(self, h):
        """Hidden states (N, d) -> float32 logits (N, V), through the model's own head (and its soft
        cap, e.g. Gemma 2's), autocast off: bf16 logits at V = 151,936 err by a few hundredths of a
        nat, ten times a weak teacher's KL."""
        f32 = lambda x: None if x is None else x.float()
        with torch.set_grad_enabled(self.grad and torch.is_grad_enabled()), torch.autocast(h.device.type, enabled=False):
            out = F.linear(h.float(), f32(self.weight), f32(self.bias))
            return out if not self.softcap else torch.tanh(out / self.softcap) * self.softcap


def per_position(f, *xs, where=None):
    """f on every position's logits -> (B, T). xs are (B, T, V) logits (tensors or Logits) or
    (B, T) tensors (e.g. the sampled tokens); f maps their (N, V) / (N,) slices to (N,).

    Tensors only: f(*xs) in one go. With Logits, `chunk` positions of the flattened batch at a time,
    each chunk's logits recomputed in the backward pass (activation checkpointing): what the
    chunks add up to is the same, but no more than one chunk's (chunk, V) logits are alive at once.
    where (B, T), with Logits: f only on the positions where it is nonzero (the agent tokens a loss
    reads), 0 elsewhere: the head's V-wide work is not spent on prompts, observations and padding."""
    lazy = [x for x in xs if isinstance(x, Logits)]
    if not lazy:
        return f(*xs)
    B, T, chunk = *lazy[0].shape[:2], lazy[0].chunk
    if where is not None:
        at = where.reshape(B * T).nonzero().squeeze(-1)                        # (N,) the positions read
        pick = lambda x: x.positions(at) if isinstance(x, Logits) else x.reshape(B * T, *x.shape[2:])[at][None]
        vals = per_position(f, *map(pick, xs)).view(-1)                         # (1, N) -> (N,)
        return vals.new_zeros(B * T).index_put((at,), vals).view(B, T)
    flat = [x.h.reshape(B * T, x.h.shape[-1]) if isinstance(x, Logits) else x.reshape(B * T, *x.shape[2:]) for x in xs]

    def piece(*rows):  # one chunk of positions, its logits made here and dropped on return
        return f(*[x.head(r) if isinstance(x, Logits) else r for x, r in zip(xs, rows)])

    track = torch.is_grad_enabled() and any(x.grad and (x.h.requires_grad or x.weight.requires_grad) for x in lazy)
    out = [checkpoint(piece, *[x[i:i + chunk] for x in flat], use_reentrant=False) if track else
           piece(*[x[i:i + chunk] for x in flat]) for i in range(0, B * T, chunk)]
    return torch.cat(out).view(B, T) if out else lazy[0].h.new_zeros(B, T, dtype=torch.float32)
