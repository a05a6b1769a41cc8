"""JumpAccumulator and JumpReport: token means, JSON shape, CSV, table."""

from __future__ import annotations

import json
import math

import pytest
import torch

from megatron_jreg.analysis.jump_accumulator import JumpAccumulator, JumpReport, reports_to_csv
from megatron_jreg.analysis.measure import pad_batch


def worked_example_states():
    """JREG.md's three-layer, one-token example: Psi = (0.146447, 0.146447, 0.5)."""
    vectors = [(1.0, 0.0), (1.0, 1.0), (0.0, 1.0), (-1.0, 0.0)]
    return [torch.tensor([[v]]) for v in vectors]  # each [b=1, s=1, h=2]


def test_worked_example():
    acc = JumpAccumulator(3)
    acc.add_states(worked_example_states())
    report = acc.report("example")
    assert report.tokens == 1
    assert report.displacement == pytest.approx([0.146447, 0.146447, 0.5], abs=1e-6)
    assert report.jump_rate == pytest.approx({"L": 35.3553, "L-1": 35.3553}, abs=1e-4)


def test_mean_over_all_tokens_not_mean_of_batch_means():
    torch.manual_seed(0)
    h = [torch.randn(4, 6, 8, dtype=torch.float64) for _ in range(3)]  # L = 2, [b, s, h]
    lengths = [6, 1, 3, 5]
    mask = torch.arange(6)[None, :] < torch.tensor(lengths)[:, None]  # [b, s]
    whole = JumpAccumulator(2)
    whole.add_states(h, mask)
    split = JumpAccumulator(2)
    split.add_states([x[:1] for x in h], mask[:1])  # a batch of 6 tokens
    split.add_states([x[1:] for x in h], mask[1:])  # and one of 9
    for layer in (1, 2):
        a, b = h[layer - 1], h[layer]
        psi = (1 - torch.nn.functional.cosine_similarity(a, b, dim=-1)) / 2
        expected = psi[mask].mean().item()
        assert whole.displacement()[layer - 1] == pytest.approx(expected, abs=1e-12)
        assert split.displacement()[layer - 1] == pytest.approx(expected, abs=1e-12)
    batch_means = (psi[:1][mask[:1]].mean() + psi[1:][mask[1:]].mean()).item() / 2
    assert abs(batch_means - split.displacement()[1]) > 1e-3  # the two really differ here
    assert whole.tokens == split.tokens == sum(lengths)


def test_padding_values_never_count():
    torch.manual_seed(1)
    h = [torch.randn(2, 5, 4) for _ in range(2)]
    mask = torch.tensor([[True] * 5, [True, True, False, False, False]])
    acc = JumpAccumulator(1)
    acc.add(1, h[0], h[1], mask)
    garbage = [x.clone() for x in h]
    garbage[1][1, 2:] = torch.randn(3, 4) * 100  # change only padded positions
    acc2 = JumpAccumulator(1)
    acc2.add(1, garbage[0], garbage[1], mask)
    assert acc.displacement() == acc2.displacement()


def test_add_sums_and_merge_match_add():
    h = worked_example_states()
    a = JumpAccumulator(3)
    a.add_states(h)
    b = JumpAccumulator(3)
    for layer, psi in enumerate([0.146447, 0.146447, 0.5], start=1):
        b.add_sums(layer, psi * 3, 3)
    a.merge(b)
    assert a.tokens == 4
    assert a.displacement() == pytest.approx([0.146447, 0.146447, 0.5], abs=1e-6)


def test_accumulator_errors():
    acc = JumpAccumulator(2)
    with pytest.raises(ValueError, match="layer must be in 1..2"):
        acc.add(3, torch.ones(1, 2), torch.ones(1, 2))
    with pytest.raises(ValueError, match="mask shape"):
        acc.add(1, torch.ones(2, 3, 4), torch.ones(2, 3, 4), torch.ones(3, 2, dtype=torch.bool))
    acc.add(1, torch.ones(1, 2), torch.ones(1, 2))
    with pytest.raises(RuntimeError, match="different token counts"):
        acc.displacement()
    with pytest.raises(ValueError, match="no tokens"):
        JumpAccumulator(2).displacement()


def test_megatron_layout_with_transposed_mask():
    torch.manual_seed(2)
    h = [torch.randn(2, 3, 4) for _ in range(2)]  # [b, s, h]
    mask = torch.tensor([[True, True, False], [True, False, False]])
    bsh = JumpAccumulator(1)
    bsh.add(1, h[0], h[1], mask)
    sbh = JumpAccumulator(1)
    sbh.add(1, h[0].transpose(0, 1), h[1].transpose(0, 1), mask.t())  # [s, b, h]
    assert bsh.displacement() == pytest.approx(sbh.displacement(), abs=1e-12)


@pytest.mark.parametrize(
    "num_layers, keys",
    [
        (1, set()),
        (2, {"L"}),
        (3, {"L", "L-1"}),
        (4, {"L", "L-1", "L-2"}),
        (12, {"L", "L-1", "L-2"}),
    ],
)
def test_jump_rate_keys(num_layers, keys):
    report = JumpReport(
        model="m",
        num_layers=num_layers,
        tokens=5,
        displacement=[0.1 * (i % 3) for i in range(num_layers)],
    )
    assert set(report.jump_rate) == keys


def test_jump_rate_values():
    psi = [0.05, 0.02, 0.03, 0.01, 0.3]
    report = JumpReport(model="m", num_layers=5, tokens=1, displacement=psi)
    # zeta_5 = 29, zeta_4 = 29 + 0, zeta_3 = 29 + 1
    assert report.jump_rate == pytest.approx({"L": 29.0, "L-1": 29.0, "L-2": 30.0})


def test_json_shape_and_round_trip():
    report = JumpReport(
        model="m",
        num_layers=3,
        tokens=7,
        displacement=[0.1, 0.05, 0.4],
        include_final_norm=True,
        extra={"source": "/x", "seq_length": 16},
    )
    data = json.loads(report.to_json())
    assert list(data)[:6] == [
        "model",
        "num_layers",
        "tokens",
        "displacement",
        "jump_rate",
        "include_final_norm",
    ]
    assert data["jump_rate"] == pytest.approx({"L": 35.0, "L-1": 35.0})
    assert data["source"] == "/x" and data["seq_length"] == 16
    back = JumpReport.from_dict(data)
    assert back == report
    with pytest.raises(ValueError, match="missing keys"):
        JumpReport.from_dict({"model": "m"})
    with pytest.raises(ValueError, match="overwrite"):
        JumpReport(model="m", num_layers=1, tokens=1, displacement=[0.1], extra={"tokens": 3})
    with pytest.raises(ValueError, match="2 displacements for 3 layers"):
        JumpReport(model="m", num_layers=3, tokens=1, displacement=[0.1, 0.2])


def test_csv_and_table():
    a = JumpReport(model="a", num_layers=3, tokens=7, displacement=[0.1, 0.05, 0.4])
    b = JumpReport(model="b", num_layers=2, tokens=7, displacement=[0.1, 0.05])
    lines = reports_to_csv([a, b]).splitlines()
    assert lines[0] == "model,layer,displacement,jump_rate"
    assert lines[1] == "a,1,0.1,"
    assert lines[3].startswith("a,3,0.4,35.0")
    assert len(lines) == 1 + 3 + 2
    table = a.format_table()
    assert "    3    0.400000    35.0000" in table
    assert "zeta_L = 35.0000   zeta_{L-1} = 35.0000" in table
    assert (
        "undefined"
        in JumpReport(model="c", num_layers=1, tokens=1, displacement=[0.2]).format_table()
    )


def test_pad_batch_is_right_padded():
    ids, mask = pad_batch([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert mask.tolist() == [[True, True, True], [True, False, False]]


def test_zero_vectors_give_half_not_nan():
    acc = JumpAccumulator(1)
    acc.add(1, torch.zeros(1, 3, 4), torch.randn(1, 3, 4))
    assert acc.displacement() == [pytest.approx(0.5)]
    assert not math.isnan(acc.displacement()[0])


def test_batches_are_read_once_not_per_layer(monkeypatch):
    """add() leaves each layer's sum on the device (reading it per layer would wait for the
    GPU inside every forward); the totals are read with one wait, and equal the float64
    formula (psi itself is fp32 for fp32 inputs)."""
    gen = torch.Generator().manual_seed(4)
    batches = [(torch.randn(2, 5, 8, generator=gen), torch.randn(2, 5, 8, generator=gen),
                torch.rand(2, 5, generator=gen) > 0.3) for _ in range(6)]
    expected_sums, expected_counts = [0.0, 0.0], [0, 0]
    for i, (a, b, mask) in enumerate(batches):
        psi = ((1 - torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1,
                                                          eps=0)) / 2)
        expected_sums[i % 2] += float(psi[mask].sum())
        expected_counts[i % 2] += int(mask.sum())
    reads = []
    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _n=name, _o=original, **k:
                            (reads.append(_n), _o(self, *a, **k))[1])
    acc = JumpAccumulator(2, impl="torch")
    for i, (a, b, mask) in enumerate(batches):
        acc.add(i % 2 + 1, a, b, mask)
    assert reads == []  # nothing read while batches are added
    sums, counts = list(acc.psi_sums), list(acc.counts)
    assert reads == ["tolist"]
    monkeypatch.undo()
    assert counts == expected_counts
    assert sums == pytest.approx(expected_sums, rel=1e-6)
