"""Report tables of the decode, attention_sweep and v4_layers sections of `make gpu-check`
(merged into benchmarks.gpu.report's renderers)."""

from __future__ import annotations

from benchmarks.common import markdown_table
from benchmarks.gpu.attention_sweep import sweep_table


def _num(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}g}" if isinstance(value, float) \
        else str(value)


def decode_table(section: dict) -> list[str]:
    rows = [[r["config"], r["batch"], r["draft"], r["status"], _num(r.get("tokens_per_s"), 4),
             _num(r.get("mean_accepted")), _num(r.get("speedup")),
             "-" if r.get("chain_accuracy") is None else f"{100 * r['chain_accuracy']:.1f}%",
             r.get("note", "")] for r in section.get("records", [])]
    return [markdown_table(["config", "batch", "drafted tokens", "status", "decode tok/s",
                            "tokens per pass", "speedup", "generated tokens on the chain",
                            "note"], rows)]


def sweep_lines(section: dict) -> list[str]:
    lines = [markdown_table(["candidate", "forward", "dq", "dkv", "full ms", "swa ms", "status",
                             "note"], sweep_table(section.get("records", [])))]
    if "chosen" in section:
        lines += ["", f"chosen: candidate {section['chosen']}, written to {section['table']}"]
    return lines


def v4_table(section: dict) -> list[str]:
    rows = [[r["length"], r["kind"], r["status"], _num(r.get("fwd_bwd_ms")), r.get("note", "")]
            for r in section.get("records", [])]
    return [markdown_table(["T", "layer", "status", "fwd+bwd ms", "note"], rows)]


TITLES = {"decode": "Decoding (greedy, batch 1 and 32)",
          "attention_sweep": "Mosaic GPU flash-attention block sweep",
          "v4_layers": "DeepSeek-V4 attention layers forward + backward"}
RENDERERS = {"decode": decode_table, "attention_sweep": sweep_lines, "v4_layers": v4_table}
