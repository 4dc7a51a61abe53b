"""Each method's teacher context is built as specified (DESIGN §2), and the two pieces of
math the baselines add: Skill-SD's importance-weighted k3 term and SDPO's EMA teacher."""
import os
import random
import sys
import types

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import envs  # noqa: E402
import lopd  # noqa: E402
import model as M  # noqa: E402
import retrieval  # noqa: E402
import train  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture
def captured(monkeypatch):
    """Replace text_prefix so that a context builder hands back its texts, not embeddings."""
    monkeypatch.setattr(train, "text_prefix", lambda model, tok, texts: list(texts))


@pytest.fixture(scope="module")
def env():
    return envs.ToolUse(n_train=200, n_eval=20)


def fake_run(env, method, **kw):
    run = types.SimpleNamespace(env=env, tok=None, teacher=None, method=train.METHODS[method], rng=random.Random(0),
                                log={"family_hit": []}, skills={}, ucb={},
                                args=types.SimpleNamespace(J=3))
    run.__dict__.update(kw)
    return run


def played(env, task, ok):
    """An expert episode (reward 1) or a wrong answer (reward 0) for the task."""
    return envs.play(env, task, env.demo(task, random.Random(0)) if ok else ["answer nobody"])


def test_opsd_context_holds_the_reference_solution(env, captured):
    eps = [env.reset(t) for t in env.train_tasks[:5]]
    texts = train.opsd_context(fake_run(env, "opsd"), eps)
    for e, t in zip(eps, texts):
        assert e.task.solution in t and e.task.answer in t


def test_sdpo_never_shows_a_rollout_its_own_attempt(env, captured):
    G = train.METHODS["sdpo"].group
    a, b = env.train_tasks[0], env.train_tasks[1]
    # group 1: exactly one success; group 2: no success
    eps = [played(env, a, ok) for ok in [True, False, False, False]] + [played(env, b, False) for _ in range(G)]
    texts = train.sdpo_context(fake_run(env, "sdpo"), eps)
    win = env.trajectory_text(eps[0])
    assert all(win in t for t in texts[1:4])            # the failures see the successful sibling
    assert win not in texts[0] and texts[0].startswith("feedback: correct")  # the success has no other winner
    for t, e in zip(texts[4:], eps[4:]):                 # no sibling succeeded: own feedback only
        assert t == f"feedback: {e.feedback}\n" and "wrong" in t
    # a rollout with neither a successful sibling nor feedback is masked out (None)
    eps[5].feedback = ""
    assert train.sdpo_context(fake_run(env, "sdpo"), eps)[5] is None


def test_sdpo_sibling_is_from_the_same_group(env, captured):
    G = train.METHODS["sdpo"].group
    a, b = env.train_tasks[0], env.train_tasks[1]
    eps = [played(env, a, False) for _ in range(G)] + [played(env, b, True)] + [played(env, b, False)] * (G - 1)
    texts = train.sdpo_context(fake_run(env, "sdpo"), eps)
    assert all(t.startswith("feedback:") for t in texts[:G])  # b's success never leaks into a's group


def test_sdft_context_is_the_experts_trajectory_of_this_task(env, captured):
    eps = [env.reset(t) for t in env.train_tasks[:4]]
    texts = train.sdft_context(fake_run(env, "sdft"), eps)
    for e, t in zip(eps, texts):
        demo = envs.play(env, e.task, env.demo(e.task, random.Random(0)))
        assert demo.reward == 1 and env.trajectory_text(demo) in t


def test_trajtext_shows_the_same_experiences_lopd_retrieves(env, captured):
    bank = retrieval.ExperienceBank(retrieval.hashing_embedder(), 100)
    wins = [played(env, t, True) for t in env.train_tasks[:40]]
    bank.add([retrieval.Experience(e.task.task_id, e.task.family, e.task.prompt, env.trajectory_text(e), 1.0)
              for e in wins])
    run = fake_run(env, "trajtext", bank=bank)
    eps = [env.reset(t) for t in env.train_tasks[:3]]
    texts = train.trajtext_context(run, eps)
    found = bank.retrieve([e.task.prompt for e in eps], [e.task.task_id for e in eps], 3)
    for t, f, e in zip(texts, found, eps):
        assert len(f) == 3 and all(m.text in t for m in f)
        assert all(m.task_id != e.task.task_id for m in f)  # never this task instance


def test_skill_text_uses_only_the_tasks_family(env, captured):
    run = fake_run(env, "skillsd")
    fams = {}
    for t in env.train_tasks[:60]:
        e = played(env, t, ok=len(fams.get(t.family, [])) % 2 == 0)
        fams.setdefault(t.family, []).append(e)
        run.skills.setdefault(t.family, []).append((env.trajectory_text(e), e.reward, e.feedback))
    eps = [env.reset(t) for t in env.eval_tasks[:10]]
    texts = train.skillsd_context(run, eps)
    for e, text in zip(eps, texts):
        own = {env.trajectory_text(x) for x in fams[e.task.family] if x.reward > 0}
        other = {env.trajectory_text(x) for f, xs in fams.items() if f != e.task.family for x in xs}
        assert text.startswith("skill: success pattern: ") and "mistakes: " in text and "workflow: " in text
        assert any(o in text for o in own) and not any(o in text for o in other)


def test_skill_text_template():
    recs = [("city(bo) -> oslo; answer oslo", 1.0, "correct"), ("answer rome", 0.0, "the answer 'rome' is wrong"),
            ("answer lima", 0.0, "the answer 'lima' is wrong"), ("answer rome", 0.0, "the answer 'rome' is wrong")]
    assert train.skill_text(recs) == ("skill: success pattern: city(bo) -> oslo; answer oslo; "
                                      "mistakes: the answer 'rome' is wrong; workflow: 2 turns, the last one answers\n")


def test_skill_text_breaks_a_tie_between_mistakes_the_same_way_in_every_process():
    # A tie once went to set() order, which follows the per-process string hash seed, so two
    # runs of one seed could show different skills. The earliest of the tied mistakes wins.
    mistakes = [f"the answer '{c}' is wrong" for c in ('rome', 'lima', 'oslo', 'bern', 'kyiv', 'rabat')]
    recs = [("answer x", 0.0, m) for m in mistakes]
    assert f"mistakes: {mistakes[0]};" in train.skill_text(recs)
    assert f"mistakes: {mistakes[2]};" in train.skill_text(recs + recs[2:3])  # a count beats order


def test_skillsd_ucb_tries_every_arm_first(env, captured):
    run = fake_run(env, "skillsd")
    fam = env.train_tasks[0].family
    run.skills[fam] = [(f"answer x{i}", 1.0, "correct") for i in range(5)]
    eps = [env.reset(t) for t in env.train_tasks[:50] if t.family == fam][:3]
    texts = train.skillsd_context(run, eps)
    assert sorted(run.ucb[fam]) == [0, 1, 2] and all(v[0] == 1 for v in run.ucb[fam].values())
    assert len(set(texts)) == 3  # three arms = three skills built on the 3 latest successes


def test_is_k3_gradient_is_the_score_function_gradient_of_reverse_kl():
    """At θ = θ_old, ∇ mean ρ(e^{−ℓ} − 1 + ℓ) = mean ℓ ∇log π_θ(y) on the sampled tokens."""
    torch.manual_seed(0)
    student = M.tiny_llama(20, d_model=16, n_layer=1).double()
    teacher = M.tiny_llama(20, d_model=16, n_layer=1).double()
    ids = torch.randint(0, 20, (3, 9))
    mask = (torch.rand(3, 9) > 0.3).double()
    logp = lopd.token_logp(student(input_ids=ids).logits, ids)
    with torch.no_grad():
        logp_t = lopd.token_logp(teacher(input_ids=ids).logits, ids)
    g_k3 = torch.autograd.grad(lopd.is_k3_loss(logp, logp.detach(), logp_t, mask), list(student.parameters()),
                               retain_graph=True)
    ell = (logp - logp_t).detach()
    surrogate = (ell * logp * mask).sum() / mask.sum()            # score function: ℓ·∇log π
    g_sf = torch.autograd.grad(surrogate, list(student.parameters()))
    for a, b in zip(g_k3, g_sf):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    assert sum(float(g.abs().sum()) for g in g_k3) > 0
    # and the value is the k3 estimate itself, >= 0, 0 when the teacher equals the student
    assert lopd.is_k3_loss(logp, logp.detach(), logp.detach(), mask).item() == pytest.approx(0.0, abs=1e-12)


def test_ema_moves_the_teacher_by_exactly_the_rate():
    torch.manual_seed(0)
    s, t = M.tiny_llama(20, d_model=16, n_layer=1), M.tiny_llama(20, d_model=16, n_layer=1)
    before = [p.detach().clone() for p in t.parameters()]
    lopd.ema_update(t, s, 0.05)
    for p_t, p0, p_s in zip(t.parameters(), before, s.parameters()):
        torch.testing.assert_close(p_t, 0.95 * p0 + 0.05 * p_s)
    assert not any(p.requires_grad and p.grad is not None for p in t.parameters())


def test_every_method_is_registered_with_a_group_that_divides_the_default_batch():
    assert set(train.METHODS) == {"lopd", "grpo", "opsd", "sdpo", "sdft", "skillsd", "trajtext"}
    assert all(train.Args().batch % m.group == 0 for m in train.METHODS.values())
