import pytest

from recsdk.data import current_shard, resolve_rank_and_world_size
from recsdk.data.testing import run_distributed


def test_defaults_without_torch_distributed() -> None:
    assert resolve_rank_and_world_size(None, None) == (0, 1)
    assert resolve_rank_and_world_size(2, 4) == (2, 4)
    assert current_shard() == (0, 1)
    assert current_shard(3, 4) == (3, 4)


@pytest.mark.parametrize(
    ("rank", "world_size", "error", "pattern"),
    [
        (0, None, ValueError, r"give both rank and world_size or neither; got rank=0, world_size=None"),
        (None, 2, ValueError, r"give both rank and world_size"),
        (2, 2, ValueError, r"rank must be in \[0, world_size=2\), got 2"),
        (-1, 2, ValueError, r"rank must be in \[0, world_size=2\), got -1"),
        (0, 0, ValueError, r"world_size must be >= 1, got 0"),
        (0.0, 2, TypeError, r"rank must be an int, got float"),
        (0, True, TypeError, r"world_size must be an int, got bool True"),
        (0, "2", TypeError, r"world_size must be an int, got str '2'"),
    ],
)
def test_bad_rank_world_size(rank: object, world_size: object, error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        resolve_rank_and_world_size(rank, world_size)  # type: ignore[arg-type]


def _shards(rank: int, world_size: int) -> tuple[tuple[int, int], tuple[int, int]]:
    return resolve_rank_and_world_size(None, None), current_shard()


def test_defaults_come_from_torch_distributed() -> None:
    assert run_distributed(_shards, 2) == [((0, 2), (0, 2)), ((1, 2), (1, 2))]
