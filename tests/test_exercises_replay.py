"""`library_parts` hands a student's loop exactly what labkit's loop trains (notebooks 02 and 03 compare on it)."""
import torch

from labkit.course.exercises.replay import library_parts
from labkit.course.exercises.show import show_source
from labkit.train import run


def test_a_hand_written_step_on_the_library_parts_reproduces_run_loss_for_loss(tmp_path):
    rec = run("single", "tiny-resnet", profile="smoke", steps=2, accum=2, amp="none", out=str(tmp_path), progress=False)
    parts = library_parts("single", "tiny-resnet", profile="smoke", steps=2, accum=2, amp="none")
    losses = []
    for _ in range(2):
        inputs, targets = next(parts.batches)
        parts.optimizer.zero_grad()
        total = 0.0
        for x, y in zip(inputs.chunk(2), targets.chunk(2)):
            loss = parts.task.loss(parts.model, x, y) / 2
            loss.backward()
            total += float(loss.detach())
        parts.optimizer.step()
        losses.append(total)
    assert torch.allclose(torch.tensor(losses), torch.tensor(rec.losses), rtol=1e-5), (losses, rec.losses)


def test_a_rank_gets_its_share_of_the_global_batch():
    whole = next(library_parts("single", "tiny-resnet", profile="smoke", steps=1).batches)[1]
    halves = [next(library_parts("ddp", "tiny-resnet", profile="smoke", steps=1, dp_rank=r, dp_size=2).batches)[1]
              for r in (0, 1)]
    assert sorted(torch.cat(halves).tolist()) == sorted(whole.tolist()) and len(halves[0]) == len(whole) // 2


def test_show_source_prints_the_code_outside_jupyter(capsys):
    show_source(library_parts)
    out = capsys.readouterr().out
    assert out.startswith("# labkit.course.exercises.replay.library_parts") and "def library_parts(" in out
