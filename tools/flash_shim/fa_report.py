"""Reads the JSON lines fa_subset.py writes (FA_RESULTS) and writes a Markdown report: per
test function, the cases collected and selected, and how the selected ones ended (passed,
failed, skipped by the test itself, refused for S_dmask, not reached in the time budget,
crashed: started and never reported); then the most frequent failure reasons. Prints a
short summary last.

    python tools/flash_shim/fa_report.py RESULTS.jsonl [--md REPORT.md] [--json SUMMARY.json]

Exit status 0 when every selected case that ran passed, was skipped by the test itself
or was the S_dmask refusal; 1 otherwise (a failure, a crash, or nothing ran).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter, defaultdict

COLUMNS = ("passed", "failed", "skipped", "refused", "not_reached", "crashed")
# Where a case's several reports disagree (a passing call, then a failing teardown), the
# worse one is the case's outcome.
_SEVERITY = {"passed": 0, "skipped": 1, "xfail": 1, "refused": 2, "not_reached": 2, "failed": 3, "crashed": 4}
_NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(\.\d+)?([eE][-+]?\d+)?")


def _func(nodeid: str) -> str:
    name = nodeid.split("::")[-1]
    return name.split("[", 1)[0]


def _family(reason: str) -> str:
    """A failure reason with its numbers replaced, so that one check failing on different
    values counts as one reason (the line number, in brackets, is kept)."""
    head, sep, where = reason.rpartition(" [")
    if not sep:
        head, where = reason, ""
    head = _NUMBER.sub("#", head)
    return f"{head} [{where}" if where else head


def load(path: str) -> dict:
    selection, started, outcome, reasons = None, set(), {}, {}
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:  # cut off by a crash
                continue
            event = rec.get("event")
            if event == "selection" and selection is None:
                selection = rec
            elif event == "start":
                started.add(rec["nodeid"])
            elif event == "report":
                nid, out = rec["nodeid"], "skipped" if rec["outcome"] == "xfail" else rec["outcome"]
                if _SEVERITY[out] >= _SEVERITY.get(outcome.get(nid), -1):
                    outcome[nid], reasons[nid] = out, rec.get("reason", "")
    for nid in started - outcome.keys():
        outcome[nid], reasons[nid] = "crashed", "started and never reported: the process died in it"
    return {"selection": selection or {"collected": {}, "selected": {}}, "outcome": outcome, "reasons": reasons}


def summarize(data: dict) -> dict:
    sel = data["selection"]
    funcs = list(sel["selected"]) or sorted({_func(n) for n in data["outcome"]})
    table = {}
    for func in funcs:
        ids = sel["selected"].get(func) or [n for n in data["outcome"] if _func(n) == func]
        counts = Counter(data["outcome"].get(n, "not_reached") for n in ids)
        row = {"collected": sel["collected"].get(func, len(ids)), "selected": len(ids)}
        row.update({c: counts.get(c, 0) for c in COLUMNS})
        table[func] = row
    failures = defaultdict(list)
    refusals = Counter()
    skips = Counter()
    for nid, out in data["outcome"].items():
        reason = data["reasons"].get(nid, "")
        if out in ("failed", "crashed"):
            failures[_family(reason)].append(nid)
        elif out == "refused":
            refusals[reason.split(":", 1)[0]] += 1
        elif out == "skipped":
            skips[reason or "(no reason given)"] += 1
    top = sorted(failures.items(), key=lambda kv: -len(kv[1]))
    total = {c: sum(r[c] for r in table.values()) for c in ("collected", "selected", *COLUMNS)}
    ok = total["failed"] == 0 and total["crashed"] == 0 and total["passed"] > 0
    return {"table": table, "total": total, "ok": ok,
            "failure_reasons": [{"count": len(ids), "reason": data["reasons"][ids[0]], "family": fam, "example": ids[0]}
                                for fam, ids in top],
            "refusals": dict(refusals), "skip_reasons": dict(skips.most_common(10)),
            "seed": sel.get("seed"), "per_func": sel.get("per_func")}


def markdown(s: dict, top: int = 15) -> str:
    head = ("function", "collected", "selected", *COLUMNS)
    lines = [f"FlashAttention 2.8.3 tests/test_flash_attn.py on fastattn.flash (FA_PER_FUNC={s['per_func']}, "
             f"FA_SEED={s['seed']})", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows = list(s["table"].items()) + [("**total**", s["total"])]
    for func, r in rows:
        lines.append("| " + " | ".join([func] + [str(r[c]) for c in head[1:]]) + " |")
    lines += ["", "refused (S_dmask): return_attn_probs=True with dropout_p > 0, fastattn.flash's one refusal: "
              f"{s['total']['refused']} cases", ""]
    if s["failure_reasons"]:
        lines += [f"## Top failure reasons ({len(s['failure_reasons'])} distinct; cases whose reasons differ only in "
                  "numbers count as one, shown by its first case's)", "",
                  "| cases | reason | example |", "|---|---|---|"]
        for f in s["failure_reasons"][:top]:
            lines.append(f"| {f['count']} | {f['reason'].replace('|', '/')} | `{f['example'].split('::')[-1]}` |")
        lines.append("")
    if s["skip_reasons"]:
        lines += ["## Skipped by the test file itself", ""]
        lines += [f"- {n}: {r}" for r, n in s["skip_reasons"].items()]
        lines.append("")
    return "\n".join(lines)


def short(s: dict) -> str:
    t = s["total"]
    out = [f"flash tests: {t['selected']} selected of {t['collected']} collected: {t['passed']} passed, "
           f"{t['failed']} failed, {t['skipped']} skipped by the test, {t['refused']} refused (S_dmask), "
           f"{t['not_reached']} not reached, {t['crashed']} crashed"]
    for func, r in s["table"].items():
        out.append(f"  {func}: {r['passed']}/{r['selected']} passed, {r['failed']} failed, {r['skipped']} skipped, "
                   f"{r['refused']} refused, {r['not_reached']} not reached" + (f", {r['crashed']} crashed"
                                                                                  if r["crashed"] else ""))
    for f in s["failure_reasons"][:5]:
        out.append(f"  [{f['count']}] {f['reason'][:200]}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results")
    ap.add_argument("--md")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    s = summarize(load(args.results))
    if args.md:
        with open(args.md, "w") as f:
            f.write(markdown(s))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=2)
    print(short(s))
    return 0 if s["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
