"""`python -m rl.compare`: the table's numbers against values worked out by hand from the
metrics files the test writes."""

import json

import pytest

from rl import compare


def write_run(directory, records):
    directory.mkdir()
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return directory


def run_records(rewards, evals):
    """Iteration i (1-based) logs rewards[i-1] and kl = i / 100; `evals` maps iteration ->
    (greedy, sampled), iteration 0 on its own line as the RL loop writes it."""
    records = [{"step": 0, "eval/accuracy": evals[0][0], "eval/sample_accuracy": evals[0][1]}]
    for i, reward in enumerate(rewards, start=1):
        record = {"step": i, "reward": reward, "kl": i / 100, "response_length": 4.0,
                  "iteration_seconds": 2.0}
        if i in evals:
            record["eval/accuracy"], record["eval/sample_accuracy"] = evals[i]
        records.append(record)
    return records


def test_table_values_match_hand_computed_means(tmp_path, capsys):
    rewards = [0.1 * i for i in range(1, 13)]  # 12 iterations: 0.1 .. 1.2
    a = write_run(tmp_path / "a", run_records(rewards, {0: (0.3, 0.1), 6: (0.4, 0.2),
                                                        12: (0.5, 0.25)}))
    b = write_run(tmp_path / "b", run_records([0.2, None], {0: (0.3, 0.1), 2: (0.35, None)}))
    out_json, out_png = tmp_path / "t.json", tmp_path / "t.png"
    assert compare.main([f"mis_po={a}", f"ppo={b}", "--json", str(out_json),
                         "--plot", str(out_png)]) == 0
    table = json.loads(out_json.read_text())
    first10 = sum(rewards[:10]) / 10  # 0.55
    last10 = sum(rewards[2:]) / 10  # 0.75
    assert table["mis_po"]["reward first 10"] == pytest.approx(first10)
    assert table["mis_po"]["reward last 10"] == pytest.approx(last10)
    assert table["mis_po"]["greedy before"] == 0.3 and table["mis_po"]["greedy after"] == 0.5
    assert table["mis_po"]["sampled after"] == 0.25
    assert table["mis_po"]["KL last 10"] == pytest.approx(sum(range(3, 13)) / 1000)
    assert table["mis_po"]["iterations"] == 12
    assert table["mis_po"]["draws / iteration"] is None  # no dynamic sampling logged
    # a null (non-finite) value is a gap, not a zero
    assert table["ppo"]["reward last 10"] == pytest.approx(0.2)
    assert table["ppo"]["sampled after"] is None
    printed = capsys.readouterr().out
    assert "| mis_po | 12 |" in printed and "| ppo | 2 |" in printed
    assert "draws / iteration" not in printed  # a column no run has is left out
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_metric_columns_take_the_last_evaluation_or_the_last_ten_mean(tmp_path):
    """Per-task columns (`--metric`): eval/ metrics at the last evaluation, others as the mean
    of the last ten logged iterations; a run without the metric shows a gap."""
    records = run_records([0.5] * 12, {0: (0.3, 0.1), 12: (0.5, 0.25)})
    for r in records[1:]:
        r["distill/kl/add"] = r["step"] / 10  # 0.1 .. 1.2
    records[0]["eval/accuracy/add"], records[-1]["eval/accuracy/add"] = 0.2, 0.6
    a = write_run(tmp_path / "a", records)
    b = write_run(tmp_path / "b", run_records([0.5], {0: (0.1, 0.1)}))
    out_json, out_png = tmp_path / "t.json", tmp_path / "t.png"
    assert compare.main([f"mopd={a}", f"rl={b}", "--metric", "eval/accuracy/add", "--metric",
                         "distill/kl/add", "--json", str(out_json), "--plot",
                         str(out_png)]) == 0
    table = json.loads(out_json.read_text())
    assert table["mopd"]["eval/accuracy/add last"] == 0.6
    assert table["mopd"]["distill/kl/add last"] == pytest.approx(sum(range(3, 13)) / 100)
    assert table["rl"]["distill/kl/add last"] is None
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, message", [
    (["nodir"], "expected NAME=DIR"),
    (["x={missing}"], "x: no metrics.jsonl in"),
    (["x={run}", "x={run}"], "run name 'x' given twice"),
])
def test_bad_arguments_get_one_line_errors(tmp_path, capsys, args, message):
    run = write_run(tmp_path / "run", run_records([0.5], {0: (0.1, 0.1)}))
    args = [a.format(missing=tmp_path / "missing", run=run) for a in args]
    with pytest.raises(SystemExit) as exit_info:
        compare.main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
