"""``fp4vis.pipelines.context_parallel.distributed`` on two CPU processes (gloo), set up as torchrun would: no rank
destroys the group while another still works, and a rank that raises leaves without waiting for the others."""

import os
import socket
import time

import torch.distributed as dist
import torch.multiprocessing as mp

from fp4vis.pipelines.context_parallel import ContextParallel, distributed

WORK_S = 1.0   # the one rank's work after the other is done (in a run: rank 0 decoding and writing)


def _worker(rank: int, out: str, port: int, fail: bool) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    done = None   # when the rank's work ended: by returning, or (``fail``) by raising; rank 1 fails late
    try:
        with distributed(ContextParallel(ulysses=2), "cpu") as session:
            assert session.rank == rank and dist.get_world_size() == 2
            if session.is_main != fail:
                time.sleep(WORK_S)
            done = time.monotonic()
            if fail:
                raise ValueError(f"rank {rank} fails")
    except ValueError:
        pass
    left = time.monotonic()
    with open(os.path.join(out, f"rank{rank}"), "w") as f:
        f.write(f"{done} {left} {dist.is_initialized()}")


def _run(tmp_path, fail: bool) -> list[list[str]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(str(tmp_path), port, fail), nprocs=2)
    return [(tmp_path / f"rank{r}").read_text().split() for r in range(2)]


def test_no_rank_leaves_before_the_others_are_done(tmp_path):
    (done0, left0, init0), (done1, left1, init1) = _run(tmp_path, fail=False)
    assert float(left1) >= float(done0) > float(done1)   # rank 1 waited for rank 0's work
    assert init0 == init1 == "False"                       # and the group is gone on both


def test_a_rank_that_raises_leaves_at_once(tmp_path):
    (done0, left0, init0), (done1, left1, init1) = _run(tmp_path, fail=True)
    assert float(left0) < float(done1)        # rank 0 raised and left before rank 1's work ended
    assert init0 == init1 == "False"
