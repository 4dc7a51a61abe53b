"""The real-model path, offline: tiny random Llama, Qwen2, Qwen3 and GPT-2 models built from
transformers configs with a byte-level tokenizer and a ChatML chat template (tests/tiny_hf.py).

- the chat template's layout: the body reads as the template renders the conversation, the
  agent mask covers exactly the assistant turns, and a template that is not one layout is one line;
- chunked scoring through the LM head equals the unchunked one (values and gradients, full and
  top-k + tail divergences), with and without LoRA;
- LoRA: θ0 is the adapter off, the EMA teacher a second adapter, only the adapter trains, a
  checkpoint holds only the adapter, gradient checkpointing changes no gradient;
- train.py --model DIR with LoRA on each architecture: a run resumed after one step ends as one
  run does, and --export writes a model that AutoModelForCausalLM reads back and that scores and
  generates as the run's student does;
- torchrun --nproc_per_node 2 (gloo): the same base evaluation as one process, and the ranks stay in step;
- --tensorboard writes the same numbers as metrics.jsonl."""
import contextlib
import copy
import io
import json
import os
import random
import subprocess
import sys

import pytest
import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
import envs  # noqa: E402
import lopd  # noqa: E402
import model as M  # noqa: E402
import tokenizer  # noqa: E402
import tiny_hf  # noqa: E402
import train  # noqa: E402
from plumbing import assemble  # noqa: E402
from plumbing import bookkeeping as bk  # noqa: E402
from conftest import TINY_BASE  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """arch -> a saved tiny model folder (built once per module)."""
    made = {}

    def get(arch, chat=True):
        if (arch, chat) not in made:
            made[arch, chat] = tiny_hf.save(tmp_path_factory.mktemp(f"{arch}-{chat}"), arch, chat)
        return made[arch, chat]
    return get


def episode(env, seed=0):
    task = env.train_tasks[seed]
    return envs.play(env, task, env.demo(task, random.Random(seed)))


# ----------------------------------------------------------------------------- the chat template

@pytest.mark.parametrize("system", [False, True])
def test_the_body_reads_as_the_template_renders_the_conversation(hf, system):
    env = envs.make_env("tooluse")
    tok, _ = M.load(hf("qwen3"), system=env.instructions if system else None)
    for seed in range(5):
        ep = episode(env, seed)
        ids, mask = M.encode_episode(tok, ep)
        msgs = [{"role": "system", "content": env.instructions}] if system else []   # the instructions: the system turn
        msgs += [{"role": "user", "content": ep.task.prompt[:tokenizer.MAX_OBS_CHARS]}]
        for action, obs in ep.turns:
            msgs.append({"role": "assistant", "content": action})
            if obs:
                msgs.append({"role": "user", "content": obs[:tokenizer.MAX_OBS_CHARS]})
        rendered = tok.hf.apply_chat_template(msgs, tokenize=False)
        assert tok.hf.decode(tok.head() + ids) + "\n" == rendered      # the template's own text, to the last character
        # the mask is the assistant turns: each action and the <|im_end|> that closes it, nothing else
        runs, cur = [], []
        for i, m in zip(ids, mask):
            if m:
                cur.append(i)
            elif cur:
                runs, cur = runs + [cur], []
        runs += [cur] if cur else []
        assert [tok.hf.decode(r) for r in runs] == [a + "<|im_end|>" for a, _ in ep.turns]
    assert tok.eot == tok.hf.convert_tokens_to_ids("<|im_end|>") and tok.vocab_size == len(tok.hf)  # no token added


def test_the_teacher_context_opens_the_first_user_turn(hf):
    tok, model = M.load(hf("qwen3"))
    ctx = M.text_prefix(model, tok, ["reference solution: city(bo)\n"])[0]
    ids = tok.context_head() + tok.encode("reference solution: city(bo)\n")
    assert torch.equal(ctx, M.embed(model, torch.tensor(ids)))
    assert tok.hf.decode(ids) == "<|im_start|>user\nreference solution: city(bo)\n"   # the task follows, in the body
    assert tok.hf.decode(tok.head()) == "<|im_start|>user\n"


def test_a_template_that_is_not_one_layout_is_refused(hf, tmp_path):
    from transformers import AutoTokenizer
    t = AutoTokenizer.from_pretrained(hf("qwen3"))
    # the turn counted into the generation prompt: the last turn does not open as the first did
    t.chat_template = tiny_hf.CHATML.replace("<|im_start|>assistant\n{% endif %}",
                                             "<|im_start|>assistant {{ messages | length }}\n{% endif %}")
    with pytest.raises(ValueError, match="not one fixed layout"):
        tokenizer.chat_layout(t)
    t.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"  # no end-of-turn token
    with pytest.raises(ValueError, match="not one fixed layout"):
        tokenizer.chat_layout(t)
    t.chat_template = tiny_hf.CHATML.replace("<|im_start|>assistant\n{% endif %}",
                                             "<|im_start|>assistant {{ messages | length }}\n{% endif %}")
    folder = tmp_path / "odd"
    t.save_pretrained(folder)
    for f in ("config.json", "model.safetensors"):
        os.link(os.path.join(hf("qwen3"), f), folder / f)
    r = subprocess.run([sys.executable, "train.py", "--model", str(folder), "--out_dir", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, env=ENV)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "not one fixed layout" in r.stderr


def test_every_weight_in_bf16_is_refused_in_one_line(hf, tmp_path, capsys):
    """--lora_r 0 on a bf16 --model would train bf16 weights under AdamW with no float32 master copy."""
    args = train.parse_args(["--model", hf("qwen3"), "--lora_r", "0", "--dtype", "bf16", "--out_dir", str(tmp_path)])
    capsys.readouterr()                                                         # the tiny model's saving, if it was built here
    with pytest.raises(SystemExit) as e:
        train.build(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and "master copy" in err


def test_auto_picks_bf16_only_where_the_card_runs_it_natively(monkeypatch):
    emulated = lambda including_emulation=True: including_emulation             # a pre-Ampere card
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", emulated)
    assert not bk.native_bf16()
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert bk.native_bf16()


def test_the_instructions_reach_student_and_teacher_once_before_the_context(hf):
    """train.py's loading: the system turn holds the instructions; the student's head and a text
    teacher's context head are the same tokens, the privileged context after them, then the task."""
    import warmup
    env = envs.make_env("tooluse")
    tok, model = warmup.load_model(train.parse_args(["--model", hf("qwen3")]), env)
    ep = episode(env)
    body, _ = M.encode_episode(tok, ep)
    student = tok.hf.decode(tok.head() + body)
    teacher = tok.hf.decode(tok.context_head() + tok.encode("past: a note\n") + body)
    assert student.count(env.instructions) == teacher.count(env.instructions) == 1
    assert teacher == student.replace("<|im_start|>user\n", "<|im_start|>user\npast: a note\n", 1)
    prefix = M.text_prefix(model, tok, ["past: a note\n"])[0]                 # what a text teacher is given
    assert torch.equal(prefix, M.embed(model, torch.tensor(tok.context_head() + tok.encode("past: a note\n"))))


def test_a_template_without_a_system_role_gets_the_instructions_in_the_first_user_turn(hf):
    from transformers import AutoTokenizer
    t = AutoTokenizer.from_pretrained(hf("qwen3"))
    t.chat_template = "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}" \
                      "{% endif %}{% endfor %}" + tiny_hf.CHATML
    env = envs.make_env("codegen")
    tok = tokenizer.Tokenizer(hf=t, system=env.instructions)
    assert t.decode(tok.head()) == "<|im_start|>user\n" + env.instructions + "\n\n"
    assert t.decode(tokenizer.Tokenizer(hf=t).head()) == "<|im_start|>user\n"      # none asked for: none there


def test_a_cut_turn_is_closed_by_the_end_of_turn_token_outside_the_mask(hf):
    """A random model rarely ends a turn: most actions are cut at max_action_tokens. Each cut one is followed
    by <|im_end|>, as the template closes a turn, with mask 0 (the policy never sampled it)."""
    env = envs.make_env("tooluse")
    tok, model = M.load(hf("qwen3"), system=env.instructions)
    torch.manual_seed(0)
    eps, bodies, masks = train.rollout(model, tok, env, env.train_tasks[:3])
    cuts = 0
    for ep, ids, mask in zip(eps, bodies, masks):
        after = [i for i in range(1, len(ids) + 1) if mask[i - 1] and (i == len(ids) or not mask[i])]  # after each agent turn
        assert len(after) == len(ep.turns)
        for i in after:   # a turn the agent ended holds its own <|im_end|>; a cut one gets it here, unmasked
            closed_here = i < len(ids) and ids[i] == tok.eot and mask[i] == 0
            assert (ids[i - 1] == tok.eot) != closed_here                      # closed once, never twice
            cuts += closed_here
    assert cuts > 0


def test_every_turn_opens_as_the_agent_generated_it(hf):
    """A Qwen3-like template: the generation prompt has an empty think block that past assistant turns
    are rendered without. The body holds what the policy was conditioned on: the block before every action."""
    from transformers import AutoTokenizer
    t = AutoTokenizer.from_pretrained(hf("qwen3"))
    think = "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    t.chat_template = tiny_hf.CHATML.replace("<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n" + think + "{% endif %}")
    tok = tokenizer.Tokenizer(hf=t)
    ep = episode(envs.make_env("tooluse"))
    ids, mask = M.encode_episode(tok, ep)
    text = t.decode(tok.head() + ids)
    assert text.count("<|im_start|>assistant\n<think>\n\n</think>\n\n") == len(ep.turns)
    assert t.decode([i for i, m in zip(ids, mask) if m]) == "".join(a + "<|im_end|>" for a, _ in ep.turns)


# ----------------------------------------------------------------------------- chunked scoring

@pytest.mark.parametrize("lora", [False, True])
def test_chunked_scoring_equals_the_whole_batch(hf, lora):
    tok, student = M.load(hf("qwen3"))
    teacher = copy.deepcopy(student).requires_grad_(False)
    if lora:
        student = M.with_lora(student, tok, 4)
        with torch.no_grad():  # a trained adapter, so that θ ≠ θ0
            for n, p in student.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.1)
    torch.manual_seed(0)
    ids = torch.randint(0, tok.vocab_size, (3, 11))
    attn = torch.ones(3, 11, dtype=torch.long)
    attn[1, 7:] = 0
    mask = (torch.rand(3, 11) < 0.6).float() * attn
    pre = lambda m: [M.embed(m, torch.tensor(tok.head() + [65] * k)) for k in range(3)]   # prefixes of 3 lengths
    results = {}
    for chunk in (0, 1, 5, 1000):
        out = []
        for kind, topk in [("rkl", 0), ("fkl", 0), ("jsd", 0), ("rkl", 16), ("jsd", 16)]:
            student.zero_grad()
            ls = M.logits_on(student, pre(student), ids, attn, chunk=chunk)
            with torch.no_grad():
                lt = M.logits_on(teacher, pre(teacher), ids, attn, chunk=chunk)
            loss = lopd.distill_loss(ls, lt, mask, kind, topk) + lopd.masked_mean(lopd.token_logp(ls, ids), mask)
            loss.backward()
            out.append((loss.detach(), torch.cat([p.grad.flatten() for p in student.parameters() if p.grad is not None])))
        if chunk:
            assert isinstance(ls, lopd.Logits) and not isinstance(lt.h, torch.nn.Parameter)
        results[chunk] = out
    for chunk in (1, 5, 1000):
        for (l0, g0), (l1, g1) in zip(results[0], results[chunk]):
            assert torch.allclose(l0, l1, atol=1e-5, rtol=0) and torch.allclose(g0, g1, atol=1e-5, rtol=1e-4)


def test_chunked_scoring_reads_a_tied_head_with_trained_special_rows(hf):
    """GPT-2 ties its head to the embedding; without a template peft wraps both to train the turn
    specials' rows, and the wrapped head has no weight of its own: chunked scoring must read the head
    the forward applies (θ's rows for θ, the original rows for θ0), values and gradients."""
    tok, base = M.load(hf("gpt2", chat=False))
    model = M.with_lora(base, tok, 4)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "trainable_tokens_delta" in n:
                p.normal_(0, 1)
    ids = torch.tensor([[tok.obs, 70, tok.agent, 71, tok.eot, tok.ctx, tok.agent, tok.eot]])
    attn = torch.ones_like(ids)
    out = {}
    for who, m in [("theta", model), ("theta0", assemble.make_teacher(model, "frozen"))]:
        for chunk in (0, 3):
            model.zero_grad()
            lp = lopd.token_logp(M.logits_on(m, M.bos_prefix(m, tok, 1), ids, attn, chunk=chunk), ids)
            lp.sum().backward() if lp.requires_grad else None
            g = [p.grad.clone() for n, p in model.named_parameters() if "trainable_tokens_delta" in n and p.grad is not None]
            out[who, chunk] = lp.detach(), g
    for who in ("theta", "theta0"):
        assert torch.allclose(out[who, 0][0], out[who, 3][0], atol=1e-5)
        assert len(out[who, 0][1]) == len(out[who, 3][1])
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(out[who, 0][1], out[who, 3][1]))
    assert out["theta", 0][1] and not out["theta0", 0][1]                      # θ0 sends no gradient to θ's rows
    assert not torch.allclose(out["theta", 0][0], out["theta0", 0][0])          # the rows differ between the two


def test_log_probs_under_bf16_autocast_are_of_float32_logits():
    """Under bf16 autocast (a CUDA run's default) the LM head runs in float32, chunked or not: at
    V = 151,936 the log-probs stay within the bf16 body's own error of an all-float32 reference,
    where bf16 logits upcast afterwards (the model's own head under autocast) err 2.5 times more."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(tiny_hf.config("qwen3", 151_936, d=64, layers=1))
    with torch.no_grad():
        m.lm_head.weight.normal_(0, 0.5)    # logits spread as a trained model's are (mean log-prob ≈ −19)
    ids = torch.randint(0, 151_936, (2, 40))
    attn = torch.ones_like(ids)
    pre = [M.embed(m, torch.tensor([1, 2, 3]))] * 2
    ref = lopd.token_logp(M.logits_on(m, pre, ids, attn), ids).detach()         # float32 throughout
    with torch.autocast("cpu", dtype=torch.bfloat16):
        whole = M.logits_on(m, pre, ids, attn)
        assert whole.dtype == torch.float32
        err = {c: (lopd.token_logp(M.logits_on(m, pre, ids, attn, chunk=c), ids).detach() - ref).abs() for c in (0, 64)}
        E, mask, P = lopd.teacher_inputs(pre, M.embed(m, ids), attn)
        bf16 = (lopd.token_logp(M.forward(m, E, mask)[0][:, P - 1:P - 1 + 40], ids).detach() - ref).abs()
    assert torch.equal(err[0], err[64])
    assert err[0].max() < 0.1 and err[0].mean() < 0.02                            # the GPU check's bounds
    assert err[0].mean() < bf16.mean() / 2


def test_chunked_logits_select_rows_as_a_tensor_does():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 30, bias=True)
    h = torch.randn(4, 5, 8)
    lazy, full = lopd.Logits(h, head.weight, head.bias, chunk=3), head(h)
    keep = torch.tensor([True, False, True, True])
    y = torch.randint(0, 30, (4, 5))
    assert torch.allclose(lopd.token_logp(lazy[keep], y[keep]), lopd.token_logp(full[keep], y[keep]), atol=1e-6)
    frozen = lazy.detach()
    with torch.no_grad():
        head.weight.add_(1.0)  # a step of θ after the teacher scored: the detached view keeps the head it had
    assert torch.allclose(lopd.token_logp(frozen, y), lopd.token_logp(full, y), atol=1e-6)
    assert not frozen.grad and frozen.weight.data_ptr() != head.weight.data_ptr()



@pytest.mark.parametrize("loss", ["distill", "topk", "composer", "logp"])
def test_the_head_on_agent_positions_only_gives_the_same_loss_and_gradient(loss):
    """With Logits, the losses run the head only on the agent positions they read (per_position's where):
    the same value and gradient, to the hidden states (the student's, or the teacher's in the composer's loss)
    and to the head, as whole (B, T, V) logits; the
    positions not read get no gradient and read 0."""
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 30, bias=True)
    h_s, h_t = torch.randn(3, 7, 8, requires_grad=True), torch.randn(3, 7, 8, requires_grad=True)   # composer: to h_t
    mask = (torch.rand(3, 7) < 0.5).float()
    y, reward = torch.randint(0, 30, (3, 7)), torch.tensor([1.0, 0.0, 0.5])
    z = torch.randn(4, 8, requires_grad=True)
    fns = {"distill": lambda s, t: lopd.distill_loss(s, t, mask),
           "topk": lambda s, t: lopd.distill_loss(s, t, mask, "fkl", topk=5),
           "composer": lambda s, t: lopd.composer_loss(s, t, y, mask, reward, 0.3, 0.05, 0.2, z, z.detach() + 1)[0],
           "logp": lambda s, t: lopd.masked_mean(lopd.token_logp(s, y, mask) - lopd.token_logp(t, y, mask), mask)}
    out = []
    for lazy in (True, False):
        head.zero_grad()
        h_s.grad = h_t.grad = None
        as_logits = (lambda h: lopd.Logits(h, head.weight, head.bias, chunk=4)) if lazy else head
        value = fns[loss](as_logits(h_s), as_logits(h_t))
        value.backward()
        grad = lambda x: torch.zeros_like(x) if x.grad is None else x.grad.clone()
        out.append((value.detach(), grad(h_s) + grad(h_t), head.weight.grad.clone()))
    for a, b in zip(*out):
        assert torch.allclose(a, b, atol=1e-6)
    assert out[0][1].abs().sum() > 0 and torch.all(out[0][1][mask == 0] == 0)
    d = lopd.divergence(lopd.Logits(h_s, head.weight, head.bias, chunk=4), lopd.Logits(h_t, head.weight, head.bias, chunk=4),
                        where=mask)
    assert torch.all(d[mask == 0] == 0) and torch.all(d[mask == 1] > 0)


# ----------------------------------------------------------------------------- LoRA

def test_no_kernels_are_fetched_from_the_hub(hf):
    """transformers kernelizes a loaded model from the Hub by default (on CUDA: code downloaded at run
    time, refused without trust_remote_code; on an H200 no step ran). model.load turns it off, and
    switching train/eval (which re-kernelizes a model that uses them) keeps it off."""
    _, m = M.load(hf("qwen3"))
    assert not m.use_kernels
    with M.train_mode(m):
        assert not m.use_kernels


def test_lora_teachers_share_the_base_weights(hf):
    tok, base = M.load(hf("llama"))
    ref = copy.deepcopy(base)
    model = M.with_lora(base, tok, 4)
    theta0, ema = assemble.make_teacher(model, "frozen"), assemble.make_teacher(model, "ema")
    ids = torch.randint(0, tok.vocab_size, (2, 9))
    logits = lambda m: m(input_ids=ids).logits
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".default" in n and "lora_" in n for n in trainable)   # only θ's adapter trains
    for _ in range(2):
        opt.zero_grad()
        logits(model).logsumexp(-1).mean().backward()
        assert all(p.grad is None for n, p in model.named_parameters() if n not in trainable)
        opt.step()
        lopd.ema_update(ema, M.trained(model), 0.25)
    assert not torch.allclose(logits(model), logits(ref))                        # θ moved
    assert torch.allclose(logits(theta0), logits(ref), atol=1e-6)                 # θ0: the adapter off is the base
    # the EMA adapter is the lerp of θ's adapter, step by step; its view is the base plus that adapter
    a, b = M.Adapter(model, "ema").parameters(), M.trained(model).parameters()
    assert len(a) == len(b) == len(trainable) and not any(x.requires_grad for x in a)
    assert all(p.requires_grad for p in b) and theta0.on is False
    manual = copy.deepcopy(model)
    with torch.no_grad():
        for pt, ps in zip(M.trained(manual).parameters(), M.Adapter(manual, "ema").parameters()):
            pt.copy_(ps)
    assert torch.allclose(logits(ema), logits(manual), atol=1e-6)
    assert not torch.allclose(logits(ema), logits(model)) and not torch.allclose(logits(ema), logits(ref))
    saved = M.trainable_state(model)
    assert set(saved) and all("lora_" in k for k in saved)                      # a checkpoint holds the adapter only
    with pytest.raises(ValueError, match="size mismatch"):
        M.load_trainable(model, {k: v for k, v in list(saved.items())[1:]})


def test_lora_trains_the_added_specials_without_a_template(hf):
    tok, base = M.load(hf("gpt2", chat=False))
    model = M.with_lora(base, tok, 4)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("trainable_tokens" in n for n in names) and any("lora_" in n for n in names)
    assert tok.chat is None and tok.decode(tok.encode("a <|eot|> b")) == "a <|eot|> b"


def test_theta0_stays_frozen_without_a_template_while_the_student_trains_its_special_rows(hf):
    """Without a chat template the six turn specials are new rows that train with θ (peft's trainable
    tokens); θ0, the same model with the adapter off, must read them as they were at the start:
    its embedding of a context, its scores of a batch, and its decoding unchanged after student steps."""
    tok, base = M.load(hf("llama", chat=False))
    model = M.with_lora(base, tok, 4)
    theta0 = assemble.make_teacher(model, "frozen")
    torch.manual_seed(0)
    ids = torch.tensor([[tok.obs, 70, 71, tok.agent, 72, tok.eot, tok.obs, 73, tok.agent]] * 2)
    attn = torch.ones_like(ids)
    ctx = lambda m: M.text_prefix(m, tok, ["past: f(x) -> y", "x"])
    look = lambda: (torch.cat([c.detach() for c in ctx(theta0)]),
                    M.logits_on(theta0, ctx(theta0), ids, attn).detach(),
                    M.generate(theta0, tok, ctx(theta0), [[tok.obs, 70, tok.agent]] * 2, 5, greedy=True))
    before = look()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-1)
    for _ in range(3):   # student steps that move every trainable row the batch touches
        opt.zero_grad()
        ls = M.logits_on(model, M.text_prefix(model, tok, ["past: f(x) -> y", "x"]), ids, attn)
        lopd.masked_mean(lopd.token_logp(ls, ids), attn.float()).backward()
        opt.step()
    student = torch.cat([c.detach() for c in ctx(model)])
    assert not torch.allclose(student, before[0])                               # θ's special rows moved
    after = look()
    assert torch.equal(after[0], before[0]) and torch.allclose(after[1], before[1], atol=1e-6)
    assert after[2] == before[2]


def test_gradient_checkpointing_changes_no_gradient(hf):
    tok, base = M.load(hf("qwen2"))
    model = M.with_lora(base, tok, 4)
    ids = torch.randint(0, tok.vocab_size, (2, 9))
    attn = torch.ones_like(ids)
    grads = []
    for ckpt in (False, True):
        if ckpt:
            M.checkpoint_activations(model)
            assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
        model.zero_grad()
        ls = M.logits_on(model, M.bos_prefix(model, tok, 2), ids, attn, chunk=4)
        lopd.masked_mean(lopd.token_logp(ls, ids), attn.float()).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert grads[0].numel() and torch.allclose(grads[0], grads[1], atol=1e-6)


# ----------------------------------------------------------------------------- train.py --model, resume, export

# a random model never ends a turn, so every turn runs to the environment's token limit: few, small steps
SMALL = ["--batch", "4", "--eval_every", "1", "--eval_tasks", "2", "--teacher_eval", "1", "--lora_r", "4"]
OWN = {"lopd": ["--init_episodes", "4", "--cold_start_steps", "1", "--warmup_steps", "1", "--warmup_batch", "4"],  # a LoRA warm-up, merged
       "opsd": ["--warmup_steps", "0", "--pool_episodes", "0"]}


def train_py(args, out_dir):
    """train.py in a process of its own, as a user runs it -> its stdout."""
    r = subprocess.run([sys.executable, "train.py", *args, "--out_dir", str(out_dir)], cwd=ROOT, capture_output=True,
                       text=True, env=ENV, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def in_process(args, out_dir):
    """train.main in this process (one thread, as the subprocesses): the same run, without a new process's start."""
    log, threads = io.StringIO(), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            train.main([*args, "--out_dir", str(out_dir)])
    finally:
        torch.set_num_threads(threads)
    return log.getvalue()


def metrics(folder):
    return [{k: v for k, v in m.items() if k != "times"} for m in map(json.loads, open(os.path.join(folder, "metrics.jsonl")))]


@pytest.mark.parametrize("arch,method", [pytest.param("llama", "lopd", marks=pytest.mark.slow), pytest.param("qwen2", "opsd", marks=pytest.mark.slow),
                                         ("qwen3", "grpo"), pytest.param("gpt2", "sdpo", marks=pytest.mark.slow)])
def test_train_resume_and_export_with_lora(hf, tmp_path, arch, method, monkeypatch):
    """3 steps in one go (a process of its own) == 1 step, then --resume (in this process); then --export.
    Every scoring of a --model run goes through the LM head in chunks (--score_chunk's default, 256)."""
    run = [*SMALL, "--model", hf(arch), "--method", method, *OWN.get(method, ["--warmup_steps", "0"]),
           *([] if method == "grpo" else ["--eval_samples", "0"])]   # the sampled evaluation: on one architecture
    budget = 12 + (4 if method == "lopd" else 0)              # 3 steps of 4 (and LOPD's bank filling)
    train_py([*run, "--episodes", str(budget), "--name", "whole"], tmp_path)
    chunks, logits_on = [], M.logits_on
    monkeypatch.setattr(M, "logits_on", lambda model, pre, ids, attn, chunk=0, rows=0: chunks.append(chunk) or
                        logits_on(model, pre, ids, attn, chunk, rows))
    in_process([*run, "--episodes", str(budget - 8), "--name", "split"], tmp_path)
    assert chunks and set(chunks) == {256}, chunks
    monkeypatch.undo()
    in_process(["--resume", str(tmp_path / "split"), "--episodes", str(budget)], tmp_path)
    assert metrics(tmp_path / "whole") == metrics(tmp_path / "split")          # to the last digit
    assert len(metrics(tmp_path / "whole")) == 4
    ckpt = torch.load(tmp_path / "whole" / "ckpt.pt", weights_only=False)
    assert all("lora_" in k for k in ckpt["model"])                            # only what trains
    if method == "sdpo":
        assert ckpt["ema"] and all("lora_" in k for k in ckpt["ema"])
    out = in_process(["--export", str(tmp_path / "whole")], tmp_path)
    assert out.strip().splitlines()[-1] == f"exported {tmp_path / 'whole' / 'export'}"
    from transformers import AutoModelForCausalLM, AutoTokenizer
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "whole" / "export")
    assert not hasattr(exported, "peft_config") and type(exported).__name__.lower().startswith(arch[:4])
    # it scores as the run's student does: θ0 + the checkpoint's adapter
    built = train.build(train.parse_args(["--resume", str(tmp_path / "whole")]))
    tok = AutoTokenizer.from_pretrained(tmp_path / "whole" / "export")
    ids = torch.tensor([built.tok.head() + built.tok.turn("city of bo", first=True)])
    with torch.no_grad():
        assert torch.allclose(exported(input_ids=ids).logits, built.model(input_ids=ids).logits, atol=1e-4)
    gen = exported.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=built.tok.pad)
    assert gen.shape[1] > ids.shape[1] and tok.decode(gen[0, :ids.shape[1]]) == built.tok.hf.decode(ids[0])


# ----------------------------------------------------------------------------- torchrun

TINY = ["--batch", "16", *TINY_BASE, "--eval_every", "2", "--eval_tasks", "16", "--teacher_eval", "8"]
TORCHRUN = [*TINY, "--eval_samples", "0"]  # each rank samples from its own stream: nothing to compare


def torchrun(args, out_dir, n=2):
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "train.py", *args,
                        "--out_dir", str(out_dir)], cwd=ROOT, capture_output=True, text=True, env=ENV, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


@pytest.mark.slow
def test_torchrun_matches_one_process_and_keeps_the_ranks_in_step(base_in, tmp_path):
    """LOPD holds the most state (the bank, φ, β). Under torchrun: the base's evaluation, split over the
    ranks and gathered, is the one process's; every rank takes the same updates (train.py checks at
    every evaluation that the ranks' weights agree, and stops if not); one rank writes one run folder;
    a run resumes under torchrun."""
    out = base_in(tmp_path)
    run = [*TORCHRUN, "--method", "lopd", "--init_episodes", "16", "--cold_start_steps", "2"]
    torchrun([*run, "--episodes", "48", "--name", "two"], out)
    torchrun(["--resume", str(tmp_path / "two"), "--episodes", "80"], out)
    in_process([*run, "--episodes", "48", "--name", "one"], out)
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert one[0] == two[0]
    assert [m["episodes"] for m in one] == [16, 48] and [m["episodes"] for m in two] == [16, 48, 80]  # the base after the bank of 16
    assert sorted(os.listdir(tmp_path / "two")) == sorted(os.listdir(tmp_path / "one"))


def test_tensorboard_holds_the_metrics(base_in, tmp_path):
    out = base_in(tmp_path)
    in_process([*TINY, "--method", "grpo", "--episodes", "32", "--tensorboard"], out)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tb = EventAccumulator(str(tmp_path / "grpo-tooluse-s0" / "tensorboard"))
    tb.Reload()
    logged = metrics(tmp_path / "grpo-tooluse-s0")
    assert [(e.step, e.value) for e in tb.Scalars("success")] == [(m["episodes"], pytest.approx(m["success"])) for m in logged]
    assert "train_reward" in tb.Tags()["scalars"] and any(t.startswith("family/") for t in tb.Tags()["scalars"])


@pytest.mark.parametrize("method,ckpt", [("sdpo", False), ("lopd", False), ("opsd", True), ("lopd", True)])
def test_a_teacher_that_needs_no_gradient_builds_no_graph(hf, tmp_path, method, ckpt):
    """With LoRA, SDPO's EMA teacher is a second adapter (peft makes an adapter trainable when it is
    switched on) and LOPD's θ0 the adapter off: in the teacher phase neither keeps a graph, and
    LOPD's step 6, which needs φ's, scores again after θ's step. With --grad_ckpt, whose hook makes
    every embedding require grad, a text teacher (OPSD's) keeps none either."""
    own = {"lopd": ["--init_episodes", "4", "--cold_start_steps", "1"], "opsd": ["--pool_episodes", "4"]}.get(method, [])
    own += ["--grad_ckpt"] if ckpt else []
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        run = train.build(train.parse_args(["--model", hf("qwen3"), "--method", method, "--warmup_steps", "0", "--lora_r", "4",
                                            "--batch", "4", "--eval_tasks", "2", "--teacher_eval", "0", "--eval_samples", "0",
                                            "--out_dir", str(tmp_path), *own]))
    graphs = []
    real = M.logits_on
    def spy(model, *a, **k):
        out = real(model, *a, **k)
        if model is run.teacher:
            graphs.append(out.h.requires_grad if isinstance(out, lopd.Logits) else out.requires_grad)
        return out
    train.M.logits_on = spy
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            (run.method.step or train.train_step)(run)
    finally:
        train.M.logits_on = real
    # SDPO: one teacher forward, no graph; LOPD: step 4 without, step 6 with φ's graph
    assert graphs == ([False, True] if method == "lopd" else [False])
    assert not any(p.requires_grad for p in M.Adapter(run.model, "ema").parameters()) if method == "sdpo" else True
