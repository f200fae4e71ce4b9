"""A batch the unsharded HashEmbeddingBagCollection rejects changes none of its state."""

from __future__ import annotations

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsdk.embedding import CountAdmission, HashEmbeddingBagCollection, HashEmbeddingBagConfig, LRUEviction


def _ebc() -> HashEmbeddingBagCollection:
    torch.manual_seed(0)
    return HashEmbeddingBagCollection(
        tables=[
            HashEmbeddingBagConfig(
                name="t_user", embedding_dim=4, num_embeddings=8, feature_names=["user"], eviction=LRUEviction()
            ),
            HashEmbeddingBagConfig(
                name="t_item",
                embedding_dim=4,
                num_embeddings=16,
                feature_names=["item"],
                admission=CountAdmission(threshold=2),
            ),
        ]
    )


def _kjt(values: list[int], lengths: list[int]) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(keys=["user", "item"], values=torch.tensor(values), lengths=torch.tensor(lengths))


def _snapshot(ebc: HashEmbeddingBagCollection) -> dict[str, torch.Tensor]:
    """Every id table tensor, every weight, and each table's step clock, copied."""
    out = {f"{t}.{k}": v.clone() for t, sd in ebc.id_table_state_dict().items() for k, v in sd.items()}
    out |= {f"weight.{k}": v.detach().clone() for k, v in ebc.state_dict().items()}
    out |= {f"step.{t}": torch.tensor(table.step) for t, table in ebc.id_tables.items()}
    return out


@pytest.mark.parametrize(
    ("values", "lengths", "pattern"),
    [
        # A new id (99) before the negative length of the first feature: it must not be inserted.
        ([99, 5, 6, 7, 8], [2, -1, 2, 2], r"negative lengths in features user \(sample 1: -1\) of"),
        # The negative length is in the second feature, after the first feature's new ids.
        ([99, 98, 6, 7, 8], [1, 2, 3, -1], r"negative lengths in features item \(sample 1: -1\) of"),
        # Lengths that sum to fewer ids than the KJT holds.
        ([99, 98, 6, 7, 8], [1, 1, 1, 1], r"sum to 4 but the KJT has 5 ids \(lengths per feature user: 2, item: 2\)"),
    ],
)
def test_rejected_batch_changes_no_id_table_weight_or_step(values: list[int], lengths: list[int], pattern: str) -> None:
    _rejected_without_change(_kjt(values, lengths), pattern)


def _keyed(keys: list[str], values: list, lengths: list[int], **kwargs: int) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(keys, torch.tensor(values), lengths=torch.tensor(lengths), **kwargs)


@pytest.mark.parametrize(
    ("kjt", "pattern"),
    [
        # A key twice (its second ids would be dropped unseen).
        (_keyed(["user", "item", "item"], [99, 5, 6], [1, 1, 1]), "repeat"),
        # Ids of shape [n, 1].
        (_keyed(["user", "item"], [[99], [5]], [1, 1]), "must be 1-D"),
        # 3 lengths for 2 features x stride 2.
        (_keyed(["user", "item"], [99, 5, 6], [1, 1, 1], stride=2), "3 lengths for 2 features x stride 2"),
    ],
)
def test_malformed_batch_changes_no_state(kjt: KeyedJaggedTensor, pattern: str) -> None:
    _rejected_without_change(kjt, pattern)


def _rejected_without_change(kjt: KeyedJaggedTensor, pattern: str) -> None:
    ebc = _ebc()
    ebc(_kjt([1, 2, 3, 4, 5, 6], [2, 1, 2, 1]))  # some state: ids stored, counts, a step
    before = _snapshot(ebc)
    assert int(before["step.t_user"]) == 1

    with pytest.raises(ValueError, match=pattern) as caught:
        ebc(kjt)
    assert "HashEmbeddingBagCollection" in str(caught.value)
    assert "user" in str(caught.value)

    after = _snapshot(ebc)
    assert after.keys() == before.keys()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed == [], f"state changed by a rejected batch: {changed}"

    # The module still works, and the rejected batch's new id was never stored.
    ebc(_kjt([1, 2, 3, 4, 5, 6], [2, 1, 2, 1]))
    assert int(ebc.id_tables["t_user"].step) == 2
    found = ebc.id_tables["t_user"].find(torch.tensor([99]))
    assert found.tolist() == [-1]
