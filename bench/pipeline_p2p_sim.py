"""How much blocking point-to-point traffic DeepSpeed's pipeline engine puts on the critical path (issue 27).

    PYTHONPATH=. python bench/pipeline_p2p_sim.py

DeepSpeed's `TrainSchedule` (deepspeed/runtime/pipe/schedule.py) runs 2 (m + p - 1) steps; in each, a stage first
exchanges with its neighbours -- a forward step sends the previous micro-batch's input gradient back and receives
an activation, a backward step receives a gradient and sends the previous activation on -- then computes. The
sends and receives are blocking rendezvous (p2p.send / p2p.recv). This replays that instruction stream for every
stage with forward time F = 1, backward B, and a one-way transfer time c, and prints the step time beyond the ideal
1F1B (m + p - 1)(F + B), per micro-batch, in units of c. `labkit.parallel.perf_model.DEEPSPEED_P2P_EXPOSED` is
the result (~4 for 4 or more stages, 2 for 2): the rendezvous with both neighbours chain, so a micro-batch waits
for about four transfers, twice the two it sends. With c = 0 the schedule is exactly 1F1B (ideal = c=0 column).
"""
from __future__ import annotations


def stage_program(stage: int, stages: int, m: int) -> list[tuple[str, int]]:
    """The instruction stream of one stage: ('SG'|'RA'|'RG'|'SA'|'F'|'B', micro-batch), in TrainSchedule's order."""
    def mb_of(step: int) -> tuple[int, bool]:
        even_step, even_stage = step % 2 == 0, stage % 2 == 0
        if even_step and even_stage:
            return step // 2 - stage // 2, True
        if not even_step and not even_stage:
            return (step - 1) // 2 - stage // 2, True
        if even_step:
            return step // 2 - stages + (stage + 1) // 2, False
        return (step - 1) // 2 - stages + 1 + stage // 2, False

    ops, prev = [], -1
    for step in range(2 * (m + stages - 1)):
        mb, forward = mb_of(step)
        valid, prev_valid = 0 <= mb < m, 0 <= prev < m
        if forward:
            ops += [("SG", prev)] * (prev_valid and stage > 0) + [("RA", mb)] * (valid and stage > 0)
        else:
            ops += [("RG", mb)] * (valid and stage < stages - 1) + [("SA", prev)] * (prev_valid and stage < stages - 1)
        ops += [("F" if forward else "B", mb)] * valid
        prev = mb
    return ops


PARTNER = {"SA": ("RA", 1), "RA": ("SA", -1), "SG": ("RG", -1), "RG": ("SG", 1)}


def simulate(stages: int, m: int, backward: float, c: float) -> float:
    """Makespan of one step: compute ops take F = 1 or `backward`; a send and its receive both end at
    max(arrival of either) + c."""
    progs = [stage_program(s, stages, m) for s in range(stages)]
    pos, clock, waiting, done = [0] * stages, [0.0] * stages, {}, {}
    moved = True
    while moved:
        moved = False
        for s in range(stages):
            while pos[s] < len(progs[s]):
                op, mb = progs[s][pos[s]]
                if op in ("F", "B"):
                    clock[s] += 1.0 if op == "F" else backward
                else:
                    other_op, step = PARTNER[op]
                    key = (op, s, mb)
                    mine = (other_op, s + step, mb)  # the partner's matching op
                    if (op, s, mb) in done:
                        clock[s] = max(clock[s], done.pop((op, s, mb)))
                    elif mine in waiting:
                        end = max(clock[s], waiting.pop(mine)) + c
                        clock[s] = end
                        done[mine] = end
                    else:
                        waiting.setdefault(key, clock[s])
                        break
                pos[s] += 1
                moved = True
    assert all(pos[s] == len(progs[s]) for s in range(stages)), "deadlock"
    return max(clock)


def main() -> None:
    c, backward = 0.05, 3.0  # full recomputation: backward = 2 forwards + 1 recomputed forward
    print(f"{'stages':>6} {'m':>4} {'ideal 1F1B':>10} {'c=0':>8} {'c=' + str(c):>8} {'exposed/(m c)':>13}")
    for stages, m in ((2, 32), (4, 32), (8, 64), (16, 64), (35, 140)):
        ideal = (m + stages - 1) * (1 + backward)
        free = simulate(stages, m, backward, 0.0)
        slow = simulate(stages, m, backward, c)
        print(f"{stages:>6} {m:>4} {ideal:>10.1f} {free:>8.1f} {slow:>8.1f} {(slow - free) / (m * c):>13.2f}")


if __name__ == "__main__":
    main()
