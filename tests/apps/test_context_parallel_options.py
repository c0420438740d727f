"""``--cp`` and the checks of ``fp4vis.pipelines.context_parallel`` that need no second process (the
two- and four-process runs are tests/patching/test_wan_context_parallel.py and
test_diffusers_context_parallel.py)."""

import pytest
import torch

from fp4vis.pipelines.context_parallel import (
    ContextParallel,
    check_exact_under_ring,
    check_heads,
    check_tokens,
    distributed,
    equal_shards,
    parse_cp,
    ring_exact_backend,
)
from fp4vis.services.usage import UsageError


@pytest.mark.parametrize(("text", "expected"), [("ulysses=2", (2, 1)), ("ring=4", (1, 4)),
                                                ("ulysses=2,ring=2", (2, 2)), (" ring = 2 , ulysses=4", (4, 2))])
def test_parse(text, expected):
    cp = parse_cp(text)
    assert (cp.ulysses, cp.ring) == expected and cp.degree == expected[0] * expected[1]
    assert parse_cp(str(cp)) == cp and cp.to_dict()["world_size"] == cp.degree


@pytest.mark.parametrize(("text", "message"), [
    ("", "--cp: expected ulysses=N, ring=N or both"), ("ulysses", "--cp: expected"),
    ("ulysses=2;ring=2", "ulysses must be a whole number"), ("ulysses=2,ulysses=2", "ulysses given twice"),
    ("ring=-2", "ring must be at least 1"), ("ring=2.5", "ring must be a whole number"),
    ("ulysses=1,ring=1", "is one rank")])
def test_parse_errors_name_the_option(text, message):
    with pytest.raises(UsageError, match=message):
        parse_cp(text)


def test_checks_before_any_work(monkeypatch):
    cp = ContextParallel(ulysses=4, ring=2)
    check_heads(40, cp)
    with pytest.raises(UsageError, match="--cp ulysses=4,ring=2: ulysses=4 does not divide the transformer's 10 heads"):
        check_heads(10, cp)
    check_tokens(32760, ContextParallel(ulysses=2))       # Wan 480x832x81: shards of 16380 (not 32-aligned: fine)
    with pytest.raises(UsageError, match="32760 tokens do not split into 16 equal shards"):
        check_tokens(32760, ContextParallel(ulysses=16))
    assert ring_exact_backend(torch.device("cpu"), torch.bfloat16) is None
    assert ring_exact_backend(torch.device("cuda"), torch.bfloat16) == "_native_cudnn"
    assert ring_exact_backend(torch.device("cuda"), torch.float32) is None
    check_exact_under_ring(ContextParallel(ring=2), torch.device("cpu"), torch.bfloat16, None)
    check_exact_under_ring(ContextParallel(ulysses=2), torch.device("cpu"), torch.bfloat16, "--policy bf16")
    with pytest.raises(UsageError, match="--cp ring=2: --exact-steps runs exact attention through diffusers' ring"):
        check_exact_under_ring(ContextParallel(ring=2), torch.device("cpu"), torch.bfloat16, "--exact-steps")
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(UsageError, match="needs 2 processes, one per GPU; launch with torchrun --nproc-per-node 2"):
        with distributed(ContextParallel(ring=2), "cpu"):
            pass
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(UsageError, match="needs 2 processes .ulysses x ring., but torchrun started 3"):
        with distributed(ContextParallel(ring=2), "cpu"):
            pass


def test_an_unequal_split_in_diffusers_sharder_is_a_usage_error():
    """diffusers' sharder asserts equal shards (no option named): ``equal_shards`` makes its AssertionError the
    one-line UsageError of --cp; other assertions pass unchanged."""
    from diffusers.hooks.context_parallel import EquipartitionSharder

    class Mesh:   # the size is all the check reads
        def size(self):
            return 2

    with pytest.raises(UsageError, match="--cp ulysses=2: a sequence the transformer splits .* does not split into 2 "
                                         "equal shards"):
        with equal_shards(ContextParallel(ulysses=2)):
            EquipartitionSharder.shard(torch.zeros(1, 7, 4), 1, Mesh())
    with pytest.raises(AssertionError, match="other"), equal_shards(ContextParallel(ulysses=2)):
        raise AssertionError("other")
    with pytest.raises(AssertionError), equal_shards(None):
        EquipartitionSharder.shard(torch.zeros(1, 7, 4), 1, Mesh())
