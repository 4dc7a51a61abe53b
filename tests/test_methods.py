"""Each method's teacher context is built as its paper describes, and the two pieces of
math the baselines add: Skill-SD's importance-weighted k3 term and SDPO's EMA teacher."""
import math
import os
import random
import sys
import types

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import envs  # noqa: E402
from plugins import tooluse_v1  # noqa: E402
from plumbing import bookkeeping as bk  # noqa: E402
import lopd  # noqa: E402
import model as M  # noqa: E402
import tokenizer  # noqa: E402
from plugins import variants  # noqa: E402
import retrieval  # noqa: E402
import train  # noqa: E402
import warmup  # noqa: E402
from conftest import TINY_BASE  # noqa: E402
from plugins import baselines  # noqa: E402
from plumbing import registry  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def env():
    return tooluse_v1.ToolUseV1(n_train=200, n_eval=20)


def fake_run(env, method, state=None, **kw):
    run = types.SimpleNamespace(env=env, tok=None, teacher=None, method=registry.METHODS[method], rng=random.Random(0),
                                args=types.SimpleNamespace(J=3, opsd_context="pool", retrieval="similar"), state=state or {"pool": {}})
    if method == "skillsd" and not state:
        run.state = registry.METHODS["skillsd"].state(run)
    run.__dict__.update(kw)
    return run


def played(env, task, ok):
    """An expert episode (reward 1) or a wrong answer (reward 0) for the task."""
    return envs.play(env, task, env.demo(task, random.Random(0)) if ok else ["answer nobody"])


def test_opsd_context_is_an_oracle_trajectory_of_this_task_from_the_pool(env):
    """The pool's trajectory of the task, as one past experience; the expert's where the pool has none;
    --opsd_context answer: this task's reference solution (plan and answer)."""
    eps = [env.reset(t) for t in env.train_tasks[:5]]
    run = fake_run(env, "opsd", state={"pool": {eps[0].task.task_id: "city(xx) -> yy; answer yy"}})
    texts = baselines.opsd_context(run, eps)
    assert texts[0] == f"past: {eps[0].task.prompt}: city(xx) -> yy; answer yy\n"
    for e, t in zip(eps[1:], texts[1:]):
        assert t == retrieval.experiences_text([(e.task.prompt, e.task.solution)]) and e.task.answer in t
    run.args.opsd_context = "answer"
    assert baselines.opsd_context(run, eps) == [f"reference solution: {e.task.solution}\n" for e in eps]


def test_opsd_donor_context_is_another_training_task_of_the_same_family_always_the_same(env):
    """--opsd_context family (OP²SD's donor, of the same family): the oracle trajectory of another training task of the
    task's family, the same donor each time the task comes back; a held-out task gets a training donor."""
    run = fake_run(env, "opsd")
    run.args.opsd_context = "family"
    train_ids = {t.task_id for t in env.train_tasks}
    for task in env.train_tasks[:20] + env.eval_tasks[:5]:
        d = baselines.donor(run, task, same_family=True)
        assert d.family == task.family and d.task_id != task.task_id and d.task_id in train_ids
        assert baselines.donor(run, task, same_family=True) is d
        text, = baselines.opsd_context(run, [env.reset(task)])
        assert text == retrieval.experiences_text([(d.prompt, d.solution)])
    donors = {baselines.donor(run, t, same_family=True).task_id for t in env.train_tasks if t.family == env.train_tasks[0].family}
    assert len(donors) > 1  # a donor per task, not one per family


def test_opsd_controls_show_another_familys_trajectory_or_nothing(env):
    """The controls: --opsd_context other = the oracle trajectory of a training task of another family (OP²SD's
    shuffled donor), the same one each time; none = an empty context (the frozen base, for every rollout)."""
    run = fake_run(env, "opsd")
    run.args.opsd_context = "other"
    for task in env.train_tasks[:20] + env.eval_tasks[:5]:
        d = baselines.donor(run, task, same_family=False)
        assert d.family != task.family and d is baselines.donor(run, task, same_family=False)
        text, = baselines.opsd_context(run, [env.reset(task)])
        assert text == retrieval.experiences_text([(d.prompt, d.solution)])
    run.args.opsd_context = "none"
    eps = [env.reset(t) for t in env.train_tasks[:3]]
    assert baselines.opsd_context(run, eps) == ['', '', '']  # a str, so embed_context frames it: a teacher, not None


def test_the_pool_holds_base_successes_of_training_tasks_only_and_counts_its_episodes(env):
    """build_pool: --pool_episodes rollouts of training tasks, their successes kept by task, the
    episodes counted; a held-out task never enters it."""
    calls = []

    def rollout(model, tok, env_, tasks, greedy=False, prefixes=None, rows=None):
        calls.append((len(tasks), rows))
        return [played(env, t, i % 2 == 0) for i, t in enumerate(tasks)], None, None

    run = fake_run(env, "opsd", episodes=0, model=None, args=types.SimpleNamespace(pool_episodes=100, decode_rows=-1),
                   lap=lambda key=None: None, device=torch.device("cpu"))
    baselines.build_pool(run, rollout)
    pool, train_ids = run.state["pool"], {t.task_id for t in env.train_tasks}
    assert calls == [(64, 0), (36, 0)] and run.episodes == 100                   # on a CPU, each fill decoded at once
    assert pool and set(pool) <= train_ids and not set(pool) & {t.task_id for t in env.eval_tasks}
    by_id = {t.task_id: t for t in env.train_tasks}
    assert all(v == env.trajectory_text(played(env, by_id[k], True)) for k, v in pool.items())  # what succeeded, as it went


def test_lopd_bank_from_the_shared_pool_holds_base_successes_and_the_experts_demo_of_each_failure(env):
    """--bank_source pool: the base's successes, and for each task it failed the expert's demo (a
    verified success); only the base's rollouts count toward the budget; held-out tasks never enter."""
    def rollout(model, tok, env_, tasks, greedy=False, prefixes=None, rows=None):
        eps = [played(env, t, i % 3 == 0) for i, t in enumerate(tasks)]
        return eps, *zip(*[M.encode_episode(tok, e) for e in eps])

    run = fake_run(env, "lopd", episodes=0, model=None, tok=tokenizer.byte_tokenizer(), lap=lambda key=None: None,
                   args=types.SimpleNamespace(init_episodes=70, batch=16, bank_source="pool", embedder="", rerank="",
                                              bank_capacity=1000, allow_same_task=False, decode_rows=-1), device=torch.device("cpu"))
    run.state = {"bank": retrieval.new_bank(run)}
    rows = retrieval.fill_bank(run, rollout)
    bank = run.state["bank"]
    assert run.episodes == 70 and len(rows) == 70 + sum(not r[0].success for r in rows)
    assert len(bank.exps) == 70 and all(x.reward == 1.0 for x in bank.exps)       # one verified success per task
    assert {x.task_id for x in bank.exps} <= {t.task_id for t in env.train_tasks}
    base_wins = {r[0].task.task_id for r in rows[:64] if r[0].success}
    assert 0 < len(base_wins) < 64                                             # both kinds are in it


def test_sdpo_never_shows_a_rollout_its_own_attempt(env):
    G = registry.METHODS["sdpo"].group
    a, b = env.train_tasks[0], env.train_tasks[1]
    # group 1: exactly one success; group 2: no success
    eps = [played(env, a, ok) for ok in [True, False, False, False]] + [played(env, b, False) for _ in range(G)]
    texts = baselines.sdpo_context(fake_run(env, "sdpo"), eps)
    win = env.trajectory_text(eps[0])
    assert all(win in t for t in texts[1:4])            # the failures see the successful sibling
    assert win not in texts[0] and texts[0].startswith("feedback: correct")  # the success has no other winner
    for t, e in zip(texts[4:], eps[4:]):                 # no sibling succeeded: own feedback only
        assert t == f"feedback: {e.feedback}\n" and "wrong" in t
    # a rollout with neither a successful sibling nor feedback is masked out (None)
    eps[5].feedback = ""
    assert baselines.sdpo_context(fake_run(env, "sdpo"), eps)[5] is None


def test_sdpo_sibling_is_from_the_same_group(env):
    G = registry.METHODS["sdpo"].group
    a, b = env.train_tasks[0], env.train_tasks[1]
    eps = [played(env, a, False) for _ in range(G)] + [played(env, b, True)] + [played(env, b, False)] * (G - 1)
    texts = baselines.sdpo_context(fake_run(env, "sdpo"), eps)
    assert all(t.startswith("feedback:") for t in texts[:G])  # b's success never leaks into a's group


def test_sdft_context_is_the_pools_trajectory_of_this_task_and_its_teacher_an_ema_at_0_01(env):
    eps = [env.reset(t) for t in env.train_tasks[:4]]
    texts = baselines.sdft_context(fake_run(env, "sdft"), eps)
    for e, t in zip(eps, texts):
        demo = envs.play(env, e.task, env.demo(e.task, random.Random(0)))
        assert demo.reward == 1 and env.trajectory_text(demo) in t
    m = registry.METHODS["sdft"]
    assert (m.teacher, m.ema_rate, m.divergence) == ("ema", 0.01, "fkl")
    assert (registry.METHODS["opsd"].teacher, registry.METHODS["opsd"].divergence) == ("frozen", "fkl")
    assert (registry.METHODS["sdpo"].teacher, registry.METHODS["sdpo"].ema_rate) == ("ema", 0.05)


def test_trajtext_shows_the_same_experiences_lopd_retrieves(env):
    bank = retrieval.ExperienceBank(retrieval.hashing_embedder(), 100)
    wins = [played(env, t, True) for t in env.train_tasks[:40]]
    bank.add([retrieval.Experience(e.task.task_id, e.task.family, e.task.prompt, env.trajectory_text(e), 1.0)
              for e in wins])
    run = fake_run(env, "trajtext", state={"bank": bank})
    eps = [env.reset(t) for t in env.train_tasks[:3]]
    texts = baselines.trajtext_context(run, eps)
    found = bank.retrieve([e.task.prompt for e in eps], [e.task.task_id for e in eps], 3)
    for t, f, e in zip(texts, found, eps):
        assert len(f) == 3 and all(m.text in t for m in f)
        assert all(m.task_id != e.task.task_id for m in f)  # never this task instance
    run.args.retrieval = "other"  # the control: other families' experiences only, as LOPD's --retrieval other shows them
    found = retrieval.retrieve(run, [e.task for e in eps], other_family=True)
    assert all(f and all(m.family != e.task.family for m in f) for f, e in zip(found, eps))
    assert list(baselines.trajtext_context(run, eps)) == [retrieval.bank_text(f) for f in found]


def test_skill_text_uses_only_the_tasks_family(env):
    run = fake_run(env, "skillsd")
    fams = {}
    for t in env.train_tasks[:60]:
        e = played(env, t, ok=len(fams.get(t.family, [])) % 2 == 0)
        fams.setdefault(t.family, []).append(e)
        run.state["skills"].setdefault(t.family, []).append((env.trajectory_text(e), e.reward, e.feedback))
    eps = [env.reset(t) for t in env.eval_tasks[:10]]
    texts = baselines.skillsd_context(run, eps)
    for e, text in zip(eps, texts):
        own = {env.trajectory_text(x) for x in fams[e.task.family] if x.reward > 0}
        other = {env.trajectory_text(x) for f, xs in fams.items() if f != e.task.family for x in xs}
        assert text.startswith("skill: success pattern: ") and "mistakes: " in text and "workflow: " in text
        assert any(o in text for o in own) and not any(o in text for o in other)


def test_skill_text_template():
    recs = [("city(bo) -> oslo; answer oslo", 1.0, "correct"), ("answer rome", 0.0, "the answer 'rome' is wrong"),
            ("answer lima", 0.0, "the answer 'lima' is wrong"), ("answer rome", 0.0, "the answer 'rome' is wrong")]
    assert warmup.skill_text(recs) == ("skill: success pattern: city(bo) -> oslo; answer oslo; "
                                      "mistakes: the answer 'rome' is wrong; workflow: 2 turns, the last one answers\n")


def test_skill_text_breaks_a_tie_between_mistakes_the_same_way_in_every_process():
    # A tie once went to set() order, which follows the per-process string hash seed, so two
    # runs of one seed could show different skills. The earliest of the tied mistakes wins.
    mistakes = [f"the answer '{c}' is wrong" for c in ('rome', 'lima', 'oslo', 'bern', 'kyiv', 'rabat')]
    recs = [("answer x", 0.0, m) for m in mistakes]
    assert f"mistakes: {mistakes[0]};" in warmup.skill_text(recs)
    assert f"mistakes: {mistakes[2]};" in warmup.skill_text(recs + recs[2:3])  # a count beats order


def test_skillsd_arms_are_skills_of_the_latest_successes(env):
    run = fake_run(env, "skillsd")
    fam = env.train_tasks[0].family
    run.state["skills"][fam] = [(f"answer x{i}", 1.0, "correct") for i in range(5)]
    e = env.reset(next(t for t in env.train_tasks if t.family == fam))
    texts = []
    for arm in range(3):
        run.state["arm"][fam] = arm
        texts.append(baselines.skillsd_context(run, [e])[0])
    assert [t.split(";")[0] for t in texts] == [f"skill: success pattern: answer x{i}" for i in (2, 3, 4)]


def step_of(env, fam_tasks, rewards):
    """A fake batch: one finished episode per reward, of the given tasks."""
    eps = [played(env, t, ok) for t, ok in zip(fam_tasks, rewards)]
    return types.SimpleNamespace(eps=eps)


def test_skillsd_bandit_credits_the_arm_whose_update_the_rollouts_followed(env):
    """The student's rollouts never see a skill, so an arm is judged by the rollouts sampled
    after the update it shaped: the arm chosen after step t conditions step t+1's teacher, and
    is credited with the family's success at the family's next step, t+2 (UCB1: unpulled arms
    first, ties to the lowest)."""
    run = fake_run(env, "skillsd")
    fam = env.train_tasks[0].family
    tasks = [t for t in env.train_tasks if t.family == fam][:4]
    after = lambda rewards: baselines.skillsd_after_step(run, step_of(env, tasks, rewards), None, None)
    after([1, 1, 1, 0])                   # step 1 used arm 0 (the default); nothing to credit yet
    s = run.state
    assert s["ucb"][fam] == {} and s["shaped"][fam] == 0 and s["arm"][fam] == 0   # nothing pulled: arm 0 first
    after([1, 0, 0, 0])                   # follows step 1's update (arm 0): arm 0 gets 0.25
    assert s["ucb"][fam] == {0: [1, 0.25]} and s["arm"][fam] == 1                    # an unpulled arm next
    after([1, 1, 0, 0])                   # follows step 2's update, which used arm 0 again
    assert s["ucb"][fam] == {0: [2, 0.75]} and s["shaped"][fam] == 1
    assert s["arm"][fam] == 1             # arm 1's credit is one appearance away: still unpulled
    after([0, 0, 0, 0])                   # follows step 3's update (arm 1): 0
    assert s["ucb"][fam] == {0: [2, 0.75], 1: [1, 0.0]} and s["arm"][fam] == 2
    after([1, 1, 1, 1])                   # follows step 4's update (arm 1 again): 1.0
    after([1, 1, 1, 1])                   # follows step 5's update (arm 2): 1.0
    stats = s["ucb"][fam]
    assert stats == {0: [2, 0.75], 1: [2, 1.0], 2: [1, 1.0]}
    # all 3 arms (the 3 latest successes) pulled: UCB1 by hand, n = 5 pulls + 1
    ucb = {a: v[1] / v[0] + math.sqrt(2 * math.log(6) / v[0]) for a, v in stats.items()}
    assert s["arm"][fam] == max(ucb, key=ucb.get) == 2


def test_skillsd_skill_for_a_family_without_records(env):
    run = fake_run(env, "skillsd")
    assert baselines.skillsd_context(run, [env.reset(env.train_tasks[0])]) == [
        "skill: success pattern: none yet; mistakes: none seen; workflow: ? turns, the last one answers\n"]


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


@pytest.mark.parametrize("name", list(registry.METHODS))
def test_every_method_is_well_formed(name):
    """Its group divides the default batch, its teacher kind is known, its flags are config fields
    with a help, and its bench entries are valid train.py flags."""
    m, args = registry.METHODS[name], train.parse_args([])
    assert args.batch % m.group == 0 and m.teacher in ("frozen", "ema", "live", "none")
    assert (m.context is None) == (m.teacher == "none")
    assert all(f.metadata["help"] and hasattr(args, k) for k, f in m.flags.items())
    for entry, b in m.bench.items():
        train.parse_args(["--method", name, *b.get("flags", [])])  # exits 2 if a flag is wrong
    train.parse_args(["--method", name, *m.bench.get(name, {}).get("knob", [])])  # the tuning grid's knob parses


# ----------------------------------------------------------------------------- with a tiny real run

TINY = ["--batch", "8", "--eval_tasks", "8", "--teacher_eval", "8", *TINY_BASE]
SETUP = {"init_episodes": "16", "cold_start_steps": "2", "steer_episodes": "16"}  # for the methods that read them


@pytest.fixture(scope="module")
def out(tmp_path_factory, base_in):
    return base_in(tmp_path_factory.mktemp("runs"))  # the shared tiny base, for every run of this file


def tiny_run(out, name, *extra):
    own = [f for k, v in SETUP.items() if k in registry.METHODS[name].flags for f in (f"--{k}", v)]
    args = train.parse_args([*TINY, *own, "--method", name, "--out_dir", str(out), "--name", name, *extra])
    os.makedirs(out / name, exist_ok=True)
    return train.build(args)


def same(a, b):
    """Deep equality of a method's packed state (tensors by value)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("name", [n for n, m in registry.METHODS.items() if m.context])
def test_evaluation_changes_no_state_and_logs_nothing(out, name):
    """Context builders are pure: evaluation (which calls them on held-out tasks) leaves the
    method's state (bank, φ, β, skills, bandit) as it was, and what a training step logged
    (e.g. family_hit) is averaged over training retrievals only."""
    import copy
    run = tiny_run(out, name)
    for _ in range(2):
        train.train_step(run)
    before, logged = copy.deepcopy(bk.pack(run.state)), copy.deepcopy(run.log)
    m = train.evaluate(run)
    assert same(bk.pack(run.state), before)
    assert "teacher_success" in m
    for k, v in logged.items():
        if k not in ("loss", "reward", "skipped"):
            vals = [x for x in v if not math.isnan(x)]
            assert m[k] == (float(np.mean(vals)) if vals else None), k


def test_demo_nll_is_each_demos_mean_agent_token_nll_scored_alone(out):
    """The evaluation's teacher_demo_nll and student_demo_nll: the batched, padded scoring equals a slow loop that
    scores one demo at a time, unpadded, and sums −log π over its agent tokens only; the latents change the teacher's."""
    from plumbing import evaluation
    run = tiny_run(out, "lopd")
    tasks = run.env.eval_tasks[:5]
    demos = evaluation.expert_demos(run.env, tasks)
    assert all(d.success for d in demos) and demos == evaluation.expert_demos(run.env, tasks)  # experts, the same each time
    prefixes = registry.with_default(run, registry.embed_context(run, run.method.context(run, [run.env.reset(t) for t in tasks])))

    def slow(model, prefix, demo):
        ids, mask = M.encode_episode(run.tok, demo)
        with torch.no_grad():
            logits = M.logits_on(model, [prefix], torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))[0]
        logp = torch.log_softmax(logits.float(), -1)
        return -sum(logp[t, ids[t]].item() for t in range(len(ids)) if mask[t]) / sum(mask)
    with torch.no_grad():
        for model, pre in [(run.teacher, prefixes), (run.model, M.bos_prefix(run.model, run.tok, len(tasks)))]:
            want = np.mean([slow(model, p, d) for p, d in zip(pre, demos)])
            assert evaluation.demo_nll(run, model, pre, demos, rows=2) == pytest.approx(want, rel=1e-4)
        bare = M.bos_prefix(run.teacher, run.tok, len(tasks))
        assert evaluation.demo_nll(run, run.teacher, prefixes, demos) != evaluation.demo_nll(run, run.teacher, bare, demos)
    assert {"teacher_demo_nll", "student_demo_nll"} <= set(train.evaluate(run))


def test_epochs_are_student_updates_toward_one_teacher_scoring(out, monkeypatch):
    """--epochs 3: the teacher scores the batch once, the student takes 3 steps on it, each loss from
    a fresh forward of the updated θ toward the same teacher logits; the after-step hook gets the
    logits of before the first step."""
    os.makedirs(out / "opsd-epochs", exist_ok=True)
    run = tiny_run(out, "opsd", "--epochs", "3", "--name", "opsd-epochs")
    calls, losses, teachers = {"teacher": 0}, [], []
    phase, loss = train.teacher_phase, run.method.loss

    def count_teacher(*a):
        calls["teacher"] += 1
        return phase(*a)

    def record(run_, b, logits_s, teacher):
        teachers.append(teacher)
        losses.append(loss(run_, b, logits_s, teacher))
        return losses[-1]
    monkeypatch.setattr(train, "teacher_phase", count_teacher)
    monkeypatch.setattr(run.method, "loss", record)
    train.train_step(run)
    assert calls["teacher"] == 1 and len(losses) == 3 and all(t is teachers[0] for t in teachers)
    assert len({round(x.item(), 7) for x in losses}) == 3  # θ moved between the steps


@pytest.mark.parametrize("name", ["lopd", "psp"])  # the plain rollout, and a method's own sampler (PSP's)
def test_temperature_reaches_the_training_rollouts_only(out, monkeypatch, name):
    """--temperature 0.7 (the paper's rollouts): every decode of a training step samples at 0.7; the
    held-out evaluation's greedy decode stays greedy."""
    os.makedirs(out / f"{name}-t07", exist_ok=True)
    run = tiny_run(out, name, "--temperature", "0.7", "--name", f"{name}-t07")
    seen, generate = [], M.generate

    def record(model, tok, prefixes, bodies, max_new, greedy, temperature=1.0, **kw):
        seen.append((greedy, temperature))
        return generate(model, tok, prefixes, bodies, max_new, greedy, temperature, **kw)
    monkeypatch.setattr(M, "generate", record)
    train.train_step(run)
    assert seen and all(s == (False, 0.7) for s in seen)
    seen.clear()
    train.rollout(run.model, run.tok, run.env, run.env.eval_tasks[:2], greedy=True)
    assert seen and all(g for g, _ in seen)


def test_a_lopd_rollout_with_nothing_retrieved_is_masked_out_of_both_losses(out, monkeypatch):
    """The bank holds only task A (3 copies), so A retrieves nothing (its own instance is
    forbidden) and B retrieves A's: in train.lopd_step, A's rollout gets no teacher, and the student
    loss (step 5) and the composer loss (step 6) equal those of B's rollout alone."""
    run = tiny_run(out, "lopd")
    a, b = run.env.train_tasks[0], next(t for t in run.env.train_tasks if t.family == run.env.train_tasks[0].family
                                         and t.task_id != run.env.train_tasks[0].task_id)
    win = played(run.env, a, True)
    run.state["bank"] = retrieval.new_bank(run)
    run.state["bank"].add([retrieval.Experience(a.task_id, a.family, a.prompt, run.env.trajectory_text(win), 1.0)] * 3)
    run.env.train_tasks, run.args.batch = [a, b], 2
    seen, played_out, real = [], [], train.rollout
    monkeypatch.setattr(train.bk, "optimizer_step", lambda run, opt, loss, params: seen.append(loss))  # θ and φ stay put
    monkeypatch.setattr(train, "rollout", lambda *x, **k: played_out.append(real(*x, **k)) or played_out[-1])
    monkeypatch.setattr(retrieval, "write_back", lambda run, eps: None)  # the bank as it was
    torch.manual_seed(0)
    train.lopd_step(run)
    eps, bodies, masks = played_out[0]
    i = [e.task.task_id for e in eps].index(b.task_id)                                  # B's row
    ids, amask, attn = M.pad_batch(bodies, masks, run.tok.pad, "cpu")
    reward = torch.tensor([e.reward for e in eps])
    ctx = train.lopd_context(run, eps)
    assert [p is None for p in ctx] == [e.task.task_id == a.task_id for e in eps]
    assert ctx.z.shape[0] == run.args.J * run.args.K                                   # B's latents only
    logits_t = M.logits_on(run.teacher, registry.with_default(run, ctx), ids, attn)
    logits_s = M.logits_on(run.model, M.bos_prefix(run.model, run.tok, 2), ids, attn)
    r = slice(i, i + 1)
    torch.testing.assert_close(seen[0], lopd.distill_loss(logits_s[r], logits_t[r], amask[r], "rkl"))
    want, _, _ = lopd.composer_loss(logits_s[r], logits_t[r], ids[r], amask[r], reward[r], 0.0, run.args.margin, run.args.lam,
                                    ctx.z, ctx.z0)
    torch.testing.assert_close(seen[1], want)


def test_the_warm_up_teaches_every_form_a_teacher_is_shown_and_no_other(env):
    """Each text context a method's teacher (or PSP's sampler) is shown opens with one of the warm-up's
    forms, and each warm-up form is shown by some method: the base learns to read what it will read."""
    import warmup
    eps = [played(env, t, ok) for t in env.train_tasks[:4] for ok in (True, False)]
    bank = retrieval.ExperienceBank(retrieval.hashing_embedder(), 100)
    bank.add([retrieval.Experience(e.task.task_id, e.task.family, e.task.prompt, env.trajectory_text(e), 1.0)
              for e in (played(env, t, True) for t in env.train_tasks[4:40])])
    shown = set()
    for name, m in registry.METHODS.items():
        run = fake_run(env, name, state={"pool": {}, "bank": bank} if name != "skillsd" else None)
        if name == "skillsd":
            baselines.skillsd_after_step(run, types.SimpleNamespace(eps=eps), None, None)
        for setting in (["pool", "answer", "family"] if m.context is baselines.opsd_context else [None]):
            run.args.opsd_context = setting
            if m.context is not None and name not in ("lopd", "acsd"):  # latents and a steering vector: no text
                shown |= {t.split(":")[0] for t in m.context(run, eps) if t}
    shown.add(variants.psp_hint(eps[1]).split(":")[0])
    pool, by_family = warmup.warmup_pool(env)
    rng, taught = random.Random(0), set()
    for _ in range(400):
        taught.add(warmup.warmup_demo(env, rng.choice(pool), by_family, rng, p_ctx=1.0)[1].split(":")[0])
    assert shown == taught == {"past", "reference solution", "skill", "feedback"}


def test_embed_context_frames_text_and_passes_the_rest():
    """A builder may answer text, an embedded prefix or None; the teacher phase gets prefixes, extras kept."""
    tok = tokenizer.byte_tokenizer()
    model = M.tiny_llama(tok.vocab_size, d_model=16, n_layer=1)
    run = types.SimpleNamespace(teacher=model, tok=tok)
    z = torch.randn(3, 16)
    out = registry.embed_context(run, registry.Prefixes(["past: a\n", z, None], found="kept"))
    torch.testing.assert_close(out[0], M.text_prefix(model, tok, ["past: a\n"])[0])   # <|bos|><|ctx|> text
    assert out[1] is z and out[2] is None and out.found == "kept"
    assert registry.embed_context(run, [None]) == [None]
