"""Float64 numpy references for DeepSeek-V4's KV compression and compressed attention, written
with explicit loops from the report's equations (9-12, 20-23, 27) and Hugging Face's layout
(CSA: channels [:c] of the previous block, [c:] of the current one; RoPE interleaved on the
trailing channels at the block's first position). They share no code with `model/`.

An entry is a tuple (vector [c], last_token, segment). Documents are runs of equal segment
ids; blocks start at document offsets 0, m, 2m, ...; a tail shorter than m makes no entry.
"""

import numpy as np


def documents(segment_row):
    """[(start, length)] of each run of equal segment ids."""
    runs, start = [], 0
    for t in range(1, len(segment_row) + 1):
        if t == len(segment_row) or segment_row[t] != segment_row[start]:
            runs.append((start, t - start))
            start = t
    return runs


def rope_interleaved(vec, position, inv_freq):
    """Rotates pairs (2i, 2i+1) of the trailing 2·len(inv_freq) channels by position·inv_freq."""
    out = np.array(vec, np.float64)
    offset = len(vec) - 2 * len(inv_freq)
    for i, freq in enumerate(inv_freq):
        a, b = out[offset + 2 * i], out[offset + 2 * i + 1]
        angle = position * freq
        out[offset + 2 * i] = a * np.cos(angle) - b * np.sin(angle)
        out[offset + 2 * i + 1] = b * np.cos(angle) + a * np.sin(angle)
    return out


def reference_compress(hidden, kv_w, gate_w, bias, norm_w, rate, overlap, inv_freq, segments,
                       eps=1e-6, positions=None):
    """hidden [B, T, d], kv_w/gate_w [d, F], bias [m, F], norm_w [c] -> per row a list of
    entries (vector, last_token, segment), each rotated at its block's first token's position
    in `positions` [B, T] (None: its offset in the document, w·m)."""
    c = len(norm_w)
    rows = []
    for b in range(hidden.shape[0]):
        kv = np.asarray(hidden[b], np.float64) @ np.asarray(kv_w, np.float64)
        gate = np.asarray(hidden[b], np.float64) @ np.asarray(gate_w, np.float64)
        entries = []
        for start, length in documents(segments[b]):
            for w in range(length // rate):
                first = start + w * rate
                slots = []  # (value [c], logit [c])
                if overlap and w > 0:  # previous block's first-half series; none for block 0
                    for j in range(rate):
                        t = first - rate + j
                        slots.append((kv[t, :c], gate[t, :c] + bias[j, :c]))
                for j in range(rate):
                    t = first + j
                    lo = c if overlap else 0
                    slots.append((kv[t, lo:lo + c], gate[t, lo:lo + c] + bias[j, lo:lo + c]))
                pooled = np.zeros(c)
                for ch in range(c):
                    logits = np.array([s[1][ch] for s in slots])
                    weights = np.exp(logits - logits.max())
                    weights /= weights.sum()
                    pooled[ch] = sum(wt * s[0][ch] for wt, s in zip(weights, slots))
                normed = pooled / np.sqrt(np.mean(pooled ** 2) + eps) * np.asarray(norm_w)
                where = w * rate if positions is None else positions[b][first]
                entries.append((rope_interleaved(normed, where, inv_freq),
                                first + rate - 1, segments[b][first]))
        rows.append(entries)
    return rows


def reference_attention(q, kv, entries, sink, window, segments, selected=None,
                        entry_probs=False):
    """q [B, T, H, c], kv [B, T, c], entries: per row a list of (vector, last, segment) indexed
    like the compressed slots (later slots are empty), sink [H], selected [B, T, k] or None
    -> [B, T, H, c] float64; with `entry_probs` also, per row and query, {slot: attention
    probability summed over heads} of the compressed entries it attends to."""
    batch, length, heads, dim = q.shape
    out = np.zeros((batch, length, heads, dim))
    probs = [[{} for _ in range(length)] for _ in range(batch)]
    for b in range(batch):
        for t in range(length):
            keys = [(None, np.asarray(kv[b, j], np.float64)) for j in range(length)
                    if 0 <= t - j < window and segments[b][j] == segments[b][t]]
            picks = (range(len(entries[b])) if selected is None
                     else [s for s in selected[b, t] if 0 <= s < len(entries[b])])
            for e in picks:
                vec, last, seg = entries[b][e]
                if last <= t and seg == segments[b][t]:
                    keys.append((e, np.asarray(vec, np.float64)))
            for h in range(heads):
                logits = [float(np.dot(q[b, t, h], k)) / np.sqrt(dim) for _, k in keys]
                top = max(logits + [float(sink[h])])
                weights = [np.exp(x - top) for x in logits]
                denom = sum(weights) + np.exp(float(sink[h]) - top)
                for wt, (slot, k) in zip(weights, keys):
                    out[b, t, h] += wt / denom * k
                    if slot is not None:
                        probs[b][t][slot] = probs[b][t].get(slot, 0.0) + wt / denom
    return (out, probs) if entry_probs else out
