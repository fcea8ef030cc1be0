"""Random agent executions (compaction, sub-agents, retries, edited histories) and a brute-force
oracle that works on token-prefix tuples, independent of the radix-tree implementation."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np

from gyre.trajectory.record import CallRecord, Role

ASST = 1  # generation-prompt / assistant header token (a message start)


@dataclass
class Thread:
    tokens: list[int]
    marks: list[int]
    role: Role
    summary_role: Role


@dataclass
class Sim:
    rng: random.Random
    vocab: int
    execution_id: str = "exec"
    records: list[CallRecord] = field(default_factory=list)

    def toks(self, lo: int, hi: int) -> list[int]:
        return [self.rng.randrange(2, self.vocab + 2) for _ in range(self.rng.randint(lo, hi))]

    def msg(self, th: Thread, body: list[int]) -> None:
        th.marks.append(len(th.tokens))
        th.tokens.extend(body)

    def call(self, input_ids: list[int], marks: list[int], role: Role, out: list[int] | None = None) -> list[int]:
        out = self.toks(1, 4) if out is None else out
        lp = [-self.rng.random() * 3 for _ in out]
        cid = len(self.records)
        self.records.append(
            CallRecord(self.execution_id, cid, role, np.array(input_ids), np.array(out), np.array(lp), policy_version=cid // 7,
                       message_starts=np.array(sorted(set(m for m in marks if m < len(input_ids))), dtype=np.int64))
        )
        return out

    def step(self, th: Thread, role: Role | None = None) -> list[int]:
        """One model call on the thread: header, sampled output, then maybe a tool result."""
        self.msg(th, [ASST])
        out = self.call(th.tokens, th.marks, role or th.role)
        th.tokens.extend(out)
        if self.rng.random() < 0.8:
            self.msg(th, self.toks(0, 3))
        return out


def random_execution(seed: int, n_events: int, vocab: int) -> list[CallRecord]:
    rng = random.Random(seed)
    sim = Sim(rng, vocab)
    sys_main = sim.toks(1, 3)
    main = Thread([], [], Role.MAIN, Role.MAIN_SUMMARY)
    sim.msg(main, list(sys_main))
    sim.msg(main, sim.toks(1, 3))
    for _ in range(n_events):
        ev = rng.random()
        if ev < 0.45:
            sim.step(main)
        elif ev < 0.55:  # retry: the same input sampled again, first attempt abandoned
            sim.msg(main, [ASST])
            first = sim.call(main.tokens, main.marks, Role.MAIN)
            # sometimes the retry repeats a prefix of the failed output, then diverges
            out = first[: rng.randint(0, len(first))] + sim.toks(1, 2) if rng.random() < 0.5 else None
            out = sim.call(main.tokens, main.marks, Role.MAIN, out)
            main.tokens.extend(out)
        elif ev < 0.65:  # edited history: the harness cuts into its last output and rewrites it
            out = sim.step(main)
            if len(main.tokens) > len(out):
                cut = len(main.tokens) - rng.randint(1, len(out) + 1)
                del main.tokens[cut:]
                main.marks = [m for m in main.marks if m < cut]
                main.tokens.extend(sim.toks(1, 3))
        elif ev < 0.75:  # compaction: the summary is re-inserted as context into a fresh prompt
            req = Thread(main.tokens + [], main.marks + [], main.summary_role, main.summary_role)
            sim.msg(req, sim.toks(1, 2))  # "summarize the conversation"
            summary = sim.step(req)
            main.tokens, main.marks = [], []
            sim.msg(main, list(sys_main))
            sim.msg(main, sim.toks(0, 2) + summary)
        elif ev < 0.9:  # sub-agent: own system prompt, a few calls, maybe a compaction
            sub = Thread([], [], Role.SUB, Role.SUB_SUMMARY)
            sim.msg(sub, sim.toks(1, 2))
            sim.msg(sub, sim.toks(1, 3))
            for _ in range(rng.randint(1, 3)):
                out = sim.step(sub)
            if rng.random() < 0.3:
                summary = sim.step(Thread(sub.tokens + [], sub.marks + [], Role.SUB_SUMMARY, Role.SUB_SUMMARY))
                sub = Thread([], [], Role.SUB, Role.SUB_SUMMARY)
                sim.msg(sub, sim.toks(1, 1) + summary)
                out = sim.step(sub)
            sim.msg(main, out + sim.toks(0, 1))  # its answer comes back as a tool result
        elif ev < 0.93 and sim.records:  # the same call recorded twice (identical tokens), any role
            last = sim.records[-1]
            sim.call(list(last.input_ids), list(last.message_starts), Role(rng.randrange(4)), list(last.output_ids))
        else:  # a side query on a prefix of the context (e.g. a title request)
            cut = rng.randint(1, len(main.tokens))
            sim.call(main.tokens[:cut] + sim.toks(0, 2), [m for m in main.marks if m < cut], Role.SUB)
    return sim.records


# ---------------------------------------------------------------------------------------------
# Oracle: everything in terms of token-prefix tuples.


def seq_of(r: CallRecord) -> tuple[int, ...]:
    return tuple(int(x) for x in np.concatenate([r.input_ids, r.output_ids]))


def sampled_prefixes(records: list[CallRecord]) -> dict[tuple[int, ...], float]:
    """prefix ending in a sampled token → behavior log-prob of the first sampler (by call_id)."""
    out: dict[tuple[int, ...], float] = {}
    for r in sorted(records, key=lambda r: r.call_id):
        s = seq_of(r)
        n_in = len(r.input_ids)
        for p in range(n_in, len(s)):
            out.setdefault(s[: p + 1], float(r.output_logprobs[p - n_in]))
    return out


def all_prefixes(records: list[CallRecord]) -> set[tuple[int, ...]]:
    return {seq_of(r)[: p + 1] for r in records for p in range(len(seq_of(r)))}


def leaf_sequences(records: list[CallRecord]) -> dict[tuple[int, ...], int]:
    """Distinct call sequences that are not a proper prefix of another → best (lowest) role."""
    seqs: dict[tuple[int, ...], int] = {}
    for r in records:
        s = seq_of(r)
        seqs[s] = min(seqs.get(s, 99), int(r.role))
    prefixes = {s[:p] for s in seqs for p in range(1, len(s))}
    return {s: role for s, role in seqs.items() if s not in prefixes}


def message_stats(records: list[CallRecord]) -> tuple[int, int]:
    """(unique message nodes, occurrences over expanded leaves) from the definition."""
    marked = {seq_of(r)[: int(m) + 1] for r in records for m in r.message_starts}
    nodes = all_prefixes(records)
    marked |= {p for p in nodes if len(p) == 1}
    leaves = leaf_sequences(records)
    ends = set(leaves) | {p[:-1] for p in marked if len(p) > 1}
    occ = sum(sum(1 for q in range(1, len(s) + 1) if s[:q] in marked) for s in leaves)
    return len(ends), occ


def unpack(micro_steps) -> list[tuple[list[int], list[tuple[int, float, int, float]]]]:
    """Each packed sequence as (tokens, [(position, logprob, exec_index, weight) of targets])."""
    out = []
    for m in micro_steps:
        cu = m.cu_seqlens.tolist()
        for a, b in zip(cu, cu[1:]):
            toks = m.input_ids[a:b].tolist()
            tg = []
            for t in range(a, b):
                if m.target_mask[t]:
                    assert int(m.targets[t]) == toks[t - a + 1]
                    tg.append((t - a, float(m.behavior_logprobs[t]), int(m.exec_index[t]), float(m.token_weight[t])))
            assert not m.target_mask[b - 1], "last position of a sequence must not be a target"
            out.append((toks, tg))
    return out
