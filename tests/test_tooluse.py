"""Tests for the default tool use (envs.ToolUse): the graded reward and each check against
hand-built states, both orders of a two-goal task rewarded, targets reached by one chain only,
the families' structure, and hostile agent text that never raises."""
import os
import random
import sys
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import envs  # noqa: E402


@pytest.fixture(scope="module")
def env():
    return envs.make_env("tooluse")


def hand_task(words, x="bo"):
    """A task on a hand-built world: bo's manager is ed, mentor cy, team red; red's lead is kai;
    ed's manager is flo and mentor gus; cy's manager is hal; kai's manager is ivy."""
    world = {"people": list(envs.NAMES), "teams": ["red", "blue", "green", "gold"],
             "lead": {"red": "kai", "blue": "ada", "green": "ada", "gold": "ada"}}
    for p in envs.NAMES:
        world[p] = {"manager": "ada", "mentor": "ada", "team": "blue"}
    world["bo"] = {"manager": "ed", "mentor": "cy", "team": "red"}
    world["ed"] = {"manager": "flo", "mentor": "gus", "team": "blue"}
    world["cy"] = {"manager": "hal", "mentor": "ada", "team": "blue"}
    world["kai"] = {"manager": "ivy", "mentor": "ada", "team": "blue"}
    targets = [envs.run_chain(world, envs.WORDS[w], x) for w in words]
    world.update(x=x, words=list(words), targets=targets)
    family = envs.family_name(words)
    return envs.Task(prompt=family.replace("X", x), family=family, task_id="hand", answer=", ".join(targets),
                     solution="", world=world)


def play(env, task, actions):
    return envs.play(env, task, actions)


def test_hand_built_world_each_check_and_the_graded_reward(env):
    task = hand_task(["zorb", "mentor"])             # mark bo's manager's manager (flo) and bo's mentor (cy)
    assert task.world["targets"] == ["flo", "cy"] and task.prompt == "zorb and mentor of bo"
    ep = play(env, task, ["manager(bo)", "manager(ed)", "mark(flo)", "mentor(bo)", "mark(cy)"])
    assert [o for _, o in ep.turns] == ["ed", "flo", "ok, left: mentor", "cy", ""]
    assert ep.done and ep.reward == 1.0 and ep.success and ep.feedback == "correct"
    half = play(env, task, ["mark(flo)", "mark(ed)"])   # one check of two: reward 1/2, not a success
    assert half.done and half.reward == 0.5 and not half.success and half.feedback == "1 of 2 checks passed"
    none = play(env, task, ["mark(kai)", "mark(ed)"])
    assert none.done and none.reward == 0.0 and none.feedback == "0 of 2 checks passed"
    single = play(env, hand_task(["quan"]), ["team(bo)", "lead(red)", "manager(kai)", "mark(ivy)"])
    assert single.reward == 1.0 and len(single.turns) == 4


def test_both_orders_of_a_two_goal_task_are_rewarded(env):
    task = hand_task(["team-lead", "glim"])          # kai, and bo's manager's mentor (gus)
    a = play(env, task, ["team(bo)", "lead(red)", "mark(kai)", "manager(bo)", "mentor(ed)", "mark(gus)"])
    b = play(env, task, ["manager(bo)", "mentor(ed)", "mark(gus)", "team(bo)", "lead(red)", "mark(kai)"])
    c = play(env, task, ["manager(bo)", "team(bo)", "mentor(ed)", "lead(red)", "mark(kai)", "mark(gus)"])  # interleaved
    assert a.reward == b.reward == c.reward == 1.0
    assert env.trajectory_text(a) != env.trajectory_text(b)


def test_the_state_the_checks_read(env):
    """Marks are the state: a mark is refused twice or for a non-person, and an episode that runs
    out of turns is graded on what it marked."""
    task = hand_task(["zorb", "mentor"])
    ep = env.reset(task)
    assert env.step(ep, "mark(cy)").obs == "ok, left: zorb" and ep.state["marked"] == ["cy"]
    assert env.step(ep, "mark(cy)").obs == "error: cy is already marked"
    assert env.step(ep, "mark(red)").obs == "error: no person 'red'"
    assert ep.state["marked"] == ["cy"] and not ep.done
    for _ in range(env.max_turns):
        if ep.done:
            break
        env.step(ep, "manager(bo)")
    assert ep.done and len(ep.turns) == env.max_turns and ep.reward == 0.5 and ep.turns[-1][1] == ""
    assert env.step(ep, "mark(flo)").reward == 0.5 and len(ep.turns) == env.max_turns  # nothing after the end


def test_scripted_expert_solves_every_task_in_either_order(env):
    rng = random.Random(0)
    orders = Counter()
    for task in env.eval_tasks + env.train_tasks[:500]:
        ep = play(env, task, env.demo(task, rng))
        assert ep.success and len(ep.turns) <= env.max_turns - 1, (task.prompt, ep.turns)
        orders[env.trajectory_text(ep).split("(")[0], task.family] += 1
    two = [f for f in env.families if " and " in f]
    assert sum(1 for (_, f) in orders if f in two) > len(two)  # some two-goal family is solved in both orders
    assert task.solution.startswith(tuple(envs.OFFICE_TOOLS))


def test_targets_are_reached_by_their_word_chain_only(env):
    for task in env.eval_tasks + env.train_tasks[:300]:
        w, x = task.world, task.world["x"]
        assert task.prompt.endswith(f" of {x}") and x not in w["targets"] and len(set(w["targets"])) == len(w["targets"])
        for word, target in zip(w["words"], w["targets"]):
            hits = [c for c in envs.CHAINS if envs.run_chain(w, c, x) == target]
            assert hits == [envs.WORDS[word]], (task.prompt, word, hits)


def test_chain_ends_are_each_chain_run_call_by_call():
    """The tasks' generation reads the 19 chains' ends at once (envs.chain_ends): the same as running each."""
    rng = random.Random(7)
    for _ in range(200):
        world = envs.office_world(rng)
        for x in envs.NAMES:
            assert envs.chain_ends(world, x) == [envs.run_chain(world, c, x) for c in envs.CHAINS]


def test_families_many_opaque_sharing_words(env):
    assert len(env.families) == 46 and len(env.opaque) == 40
    assert len(envs.CHAINS) == 19 and len(envs.WORD_CHAINS) == 11 == len(envs.WORDS)
    uses = Counter(w for f in env.opaque for w in envs.family_words(f) if w in envs.OPAQUE_WORDS)
    assert set(uses) == set(envs.OPAQUE_WORDS) and set(uses.values()) == {6}  # each opaque word in six families
    transparent = [f for f in env.families if f not in env.opaque]
    assert all(w in envs.TRANSPARENT_WORDS for f in transparent for w in envs.family_words(f))
    counts = Counter(t.family for t in env.eval_tasks)
    assert len(env.eval_tasks) == 500 and set(counts) == set(env.families) and max(counts.values()) - min(counts.values()) <= 1


def test_noisy_expert_guesses_opaque_chains_and_never_marks_twice(env):
    rng = random.Random(0)
    right = Counter()
    for task in env.train_tasks[:2000]:
        actions = env.demo(task, rng, noisy=True)
        ep = play(env, task, actions)
        assert ep.done and all(not o.startswith("error") for _, o in ep.turns), ep.turns
        for word, target in zip(task.world["words"], task.world["targets"]):
            right[word in envs.OPAQUE_WORDS, target in ep.state["marked"]] += 1
    opaque = right[True, True] / (right[True, True] + right[True, False])
    assert 0.06 < opaque < 0.13                        # one of the 11 chains: a lucky sub-goal about 1 time in 11
    assert right[False, True] / (right[False, True] + right[False, False]) > 0.85


def test_reading_plans_never_show_an_opaque_chain(env):
    rng = random.Random(0)
    for task in env.train_tasks[:300]:
        plan = env.reading_plan(task, rng)["plan"]
        for word, chain in zip(task.world["words"], plan):
            assert (chain == envs.WORDS[word]) == (word in envs.TRANSPARENT_WORDS)


def test_tasks_are_fixed_by_the_seed_and_held_out_disjoint(env):
    again = envs.make_env("tooluse")
    assert [(t.prompt, t.answer) for t in again.eval_tasks] == [(t.prompt, t.answer) for t in env.eval_tasks]
    assert not {t.task_id for t in env.eval_tasks} & {t.task_id for t in env.train_tasks}


junk = st.one_of(
    st.text(max_size=200),
    st.binary(max_size=100).map(lambda b: b.decode("utf-8", errors="replace")),
    st.text(min_size=1, max_size=3).map(lambda s: s * 100_000),
    st.sampled_from(["mark()", "mark(bo", "mark(people)", "mark(x)", "mark(teams)", "lead(\n)", "<|eot|>", "answer bo",
                     "mark(bo)" * 20, "manager(" + "a" * 60 + ")"]),
    st.builds(lambda t, a: f"{t}({a})", st.sampled_from(list(envs.OFFICE_TOOLS) + ["mark", "city", "x"]),
              st.sampled_from(envs.NAMES + envs.TEAMS + ["", "people", "teams", "lead", "x", "targets"])),
    st.none(), st.integers(), st.binary(max_size=20), st.just(["mark(bo)"]),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions=st.lists(junk, min_size=1, max_size=12), i=st.integers(0, 499))
def test_junk_actions_never_raise_and_episodes_end(env, actions, i):
    task = env.eval_tasks[i]
    ep = env.reset(task)
    for a in actions + ["manager(nobody)"] * env.max_turns:
        if ep.done:
            break
        step = env.step(ep, a)
        assert isinstance(step.obs, str) and 0.0 <= step.reward <= 1.0
    assert ep.done and len(ep.turns) <= env.max_turns and len(ep.state["marked"]) <= len(task.world["targets"])
    assert ep.reward == sum(t in ep.state["marked"] for t in task.world["targets"]) / len(task.world["targets"])
    assert all(p in task.world["people"] for p in ep.state["marked"])
    assert all(len(act) <= 2 * envs.MAX_ACTION_CHARS for act, _ in ep.turns)


def test_action_types_and_their_shares_on_a_hand_built_episode(env):
    """What success hides: a lookup, the same lookup again (repeated), a mark of a person a lookup
    returned, a guessed (blind) mark, and text that is no tool call."""
    task = hand_task(["zorb", "mentor"])             # targets flo and cy
    ep = play(env, task, ["manager(bo)", "manager(bo)", "say hi", "mark(ed)", "mark(cy)"])   # two marks end it
    assert [env.action_kind(ep, i) for i in range(5)] == ["lookup", "lookup", "malformed", "mark", "blind mark"]
    s = envs.action_stats(env, [ep, play(env, task, ["manager(bo)"])])
    assert s == {"lookup": 3 / 6, "mark": 1 / 6, "blind mark": 1 / 6, "malformed": 1 / 6, "repeated": 1 / 6,
                 "actions_per_episode": 3.0, "chars_per_action": sum(map(len, ["manager(bo)"] * 3 + ["mark(ed)", "mark(cy)", "say hi"])) / 6}
    assert envs.action_stats(env, []) == {"repeated": 0.0, "actions_per_episode": 0.0, "chars_per_action": 0.0}
