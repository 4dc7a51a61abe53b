"""A forker's variant in a file of its own: the teacher is shown the student's best earlier attempt
at this very task, kept in a per-task memory that the run checkpoints like any method's state.
Next to train.py: `python my_variant.py --method best-attempt` (tests/test_fork.py runs it so)."""
import train
from plumbing.registry import Method, distill, register
from retrieval import experiences_text


def best_attempt_context(run, eps):
    """The teacher reads the best earlier attempt at this task (a text); a task never tried gets no teacher."""
    best = run.state['best']
    return [experiences_text([(e.task.prompt, best[e.task.task_id][1])]) if e.task.task_id in best else None for e in eps]


def remember(run, b, logits_s, teacher):
    """After the step: each task's best attempt so far (a later one wins a tie)."""
    for e in b.eps:
        if e.reward >= run.state['best'].get(e.task.task_id, (-1.0, ''))[0]:
            run.state['best'][e.task.task_id] = (e.reward, run.env.trajectory_text(e))
    return {'remembered': float(len(run.state['best']))}


register('best-attempt', Method(distill, context=best_attempt_context, group=4, state=lambda run: {'best': {}}, after_step=remember))
if __name__ == '__main__':
    train.main()
