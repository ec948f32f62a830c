"""Config files, sweep expansion and the parallel warm run (worker processes with the
fake core on the CPU)."""

import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastattn import AttentionConfig, InvalidArgumentError, config_files, warm


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_json_and_toml_sweeps_expand_alike(tmp_path):
    j = write(tmp_path, "s.json", json.dumps({"configs": [
        {"batch": [1, 2], "heads_q": 32, "heads_kv": 8, "seqlen_q": {"from": 512, "to": 2048, "times": 2},
         "head_dim_qk": 128, "mask": ["none", "causal"]},
        {"batch": 1, "heads_q": 8, "seqlen_q": {"from": 100, "to": 300, "step": 100}, "head_dim_qk": 64,
         "window": [[16, 0], [32, 0]], "mask": "causal", "layout": ["bshd", "bhsd"]},
    ]}))
    t = write(tmp_path, "s.toml", """
[[configs]]
batch = [1, 2]
heads_q = 32
heads_kv = 8
seqlen_q = { from = 512, to = 2048, times = 2 }
head_dim_qk = 128
mask = ["none", "causal"]

[[configs]]
batch = 1
heads_q = 8
seqlen_q = { from = 100, to = 300, step = 100 }
head_dim_qk = 64
window = [[16, 0], [32, 0]]
mask = "causal"
layout = ["bshd", "bhsd"]
""")
    a, b = config_files.load_configs(j), config_files.load_configs(t)
    assert a == b and len(a) == 2 * 3 * 2 + 3 * 2 * 2
    assert {c.seqlen_q for c in a[:12]} == {512, 1024, 2048}
    assert {c.window for c in a[12:]} == {(16, -1), (32, -1)} and {c.layout for c in a[12:]} == {"bshd", "bhsd"}


def test_feature_fields_sweep_like_any_other(tmp_path):
    t = write(tmp_path, "f.toml", """
[[configs]]
batch = 2
heads_q = 8
seqlen_q = 256
head_dim_qk = 64
training = true
bias = ["none", "1hss"]
dropout = [0.0, 0.1]
sinks = [false, true]
""")
    configs = config_files.load_configs(t)
    assert len(configs) == 8 and {(c.bias, c.dropout > 0, c.sinks) for c in configs} == {
        (b, d, s) for b in ("none", "1hss") for d in (False, True) for s in (False, True)}
    with pytest.raises(InvalidArgumentError, match="bias_grad=True: needs a bias"):
        config_files.load_configs(write(tmp_path, "g.json", json.dumps({"configs": [
            {"batch": 1, "heads_q": 8, "seqlen_q": 64, "head_dim_qk": 64, "training": True, "bias_grad": True}]})))


def test_features_are_kernel_families_of_their_own():
    from fastattn.warm import kernel_family

    base = AttentionConfig(batch=1, heads_q=8, seqlen_q=256, head_dim_qk=64, training=True)
    variants = [base, base.replace(bias="1hss"), base.replace(dropout=0.1), base.replace(sinks=True),
                base.replace(padding=True), base.replace(padding=True, ragged=True), base.replace(alibi=True,
                                                                                                mask="causal")]
    assert len({kernel_family(c) for c in variants}) == len(variants)
    # Sizes are not kernels: another dropout rate, batch or bias batch shares the family.
    assert kernel_family(base.replace(dropout=0.1)) == kernel_family(base.replace(dropout=0.3, batch=4))
    assert kernel_family(base.replace(bias="1hss")) == kernel_family(base.replace(bias="bhss", batch=3))


def test_duplicates_are_dropped_in_order(tmp_path):
    p = write(tmp_path, "d.json", json.dumps([
        {"batch": 1, "heads_q": 8, "seqlen_q": 64, "head_dim_qk": 64},
        {"batch": [2, 1], "heads_q": 8, "seqlen_q": 64, "head_dim_qk": 64, "dtype": "bfloat16"},
    ]))
    assert [c.batch for c in config_files.load_configs(p)] == [1, 2]


@pytest.mark.parametrize("text,match", [
    ('{"configs": [{"batch": 1,\n "heads_q": }]}', r"d\.json:2:\d+: not valid JSON"),
    ('{"configs": [\n  {"batch": 1, "heads_q": 8, "seqlen_q": 64, "head_dim_qk": 64},\n'
     '  {"batch": 0, "heads_q": 8, "seqlen_q": 64, "head_dim_qk": 64}\n]}', r"d\.json:3: configs\[1\]: batch=0"),
    ('{"configs": [{"batch": 1, "heads_q": 8, "seqlen_q": {"from": 9, "to": 1}, "head_dim_qk": 64}]}',
     r"configs\[0\]\.seqlen_q: from=9 is greater than to=1"),
    ('{"configs": [{"batch": 1, "heads_q": 8, "seqlen_q": {"start": 1}, "head_dim_qk": 64}]}', r"a range is"),
    ('{"configs": [{"batch": [], "heads_q": 8, "seqlen_q": 64, "head_dim_qk": 64}]}', r"configs\[0\]\.batch: an empty"),
    ('{"config": []}', r"config=\[\]: is not a field of AttentionConfig nor 'configs' \(did you mean 'configs'\?"),
    ('{"configs": [], "extra": 1}', r"unknown top-level key 'extra'"),
    ('{"configs": [{"batch": 1, "heads_q": 8, "seqlen": 64, "head_dim_qk": 64}]}', r"seqlen=64: is not a field"),
    ('{"configs": [{"batch": {"from": 1, "to": 1000}, "heads_q": 8, "seqlen_q": {"from": 1, "to": 1000},'
     ' "head_dim_qk": 64}]}', r"expands to"),
])
def test_file_errors_point_at_file_line_and_field(tmp_path, text, match):
    with pytest.raises(InvalidArgumentError, match=match):
        config_files.load_configs(write(tmp_path, "d.json", text))


def test_toml_syntax_error_names_the_file(tmp_path):
    with pytest.raises(InvalidArgumentError, match=r"t\.toml:2:9: not valid TOML"):
        config_files.load_configs(write(tmp_path, "t.toml", "[[configs]]\nbatch = \n"))
    with pytest.raises(InvalidArgumentError, match=r"nope\.json: No such file"):
        config_files.load_configs(str(tmp_path / "nope.json"))


def test_builtin_set_is_valid_and_varied():
    configs = config_files.builtin_configs()
    assert len(configs) == len(set(configs)) >= 64
    assert {c.head_dim_qk for c in configs} >= {64, 128, 256}
    assert any(c.heads_kv < c.heads_q for c in configs) and any(c.heads_kv == c.heads_q for c in configs)



def cfgs(*seqlens, **kw):
    base = dict(batch=1, heads_q=8, head_dim_qk=64, mask="causal")
    return [AttentionConfig(**{**base, "seqlen_q": s, **kw}) for s in seqlens]


def test_warm_builds_then_loads_and_survives_a_crash(fake_workers):
    configs = cfgs(128, 256, 384, 512) + cfgs(128, head_dim_qk=1024) + cfgs(128, head_dim_qk=72) + cfgs(640, 768)
    seen = []
    report = warm.warm(configs, workers=3, progress=lambda done, total, item: seen.append((done, total)))
    by_status = {i.config: i for i in report.items}
    crashed = by_status[configs[5]]
    assert crashed.status == "failed" and crashed.error_type == "SIGSEGV" and "SIGSEGV" in crashed.reason
    assert by_status[configs[4]].status == "unsupported" and "1024" in by_status[configs[4]].reason
    assert report.counts == {"built": 6, "loaded": 0, "unsupported": 1, "failed": 1}
    assert [d for d, _ in seen] == list(range(1, 9)) and all(t == 8 for _, t in seen)
    again = warm.warm(configs, workers=2)
    assert again.counts == {"built": 0, "loaded": 6, "unsupported": 1, "failed": 1}
    assert {i.status for i in again.items if i.config.head_dim_qk == 64} == {"loaded"}


def test_warm_reports_a_missing_gpu_stack_per_config(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FASTATTN_CUDNN_PATH", "/nonexistent/libcudnn.so.9")
    report = warm.warm(cfgs(128, 256), workers=2)
    assert report.counts["failed"] == 2
    assert {i.error_type for i in report.items} == {"LibraryError"}
    assert all("FASTATTN_CUDNN_PATH" in i.reason for i in report.items)


def test_warm_rejects_bad_worker_counts():
    with pytest.raises(InvalidArgumentError, match="^workers=0"):
        warm.warm([], workers=0)
    assert warm.warm([], workers=2).items == []


def test_a_hanging_config_is_killed_after_the_timeout(fake_workers):
    configs = cfgs(128, 256) + cfgs(128, head_dim_qk=80)
    t0 = time.monotonic()
    report = warm.warm(configs, workers=2, timeout=2.0)
    assert time.monotonic() - t0 < 30
    hung = report.items[2]
    assert hung.status == "failed" and hung.error_type == "timeout" and "killed" in hung.reason
    assert report.counts["built"] == 2


def test_a_second_run_answers_from_the_cache_without_workers(fake_workers, monkeypatch):
    import fake_core
    from fastattn import runtime

    configs = cfgs(128, 256) + cfgs(128, head_dim_qk=1024)
    first = warm.warm(configs, workers=2)
    assert first.counts == {"built": 2, "loaded": 0, "unsupported": 1, "failed": 0}
    # This process can now read the cache too (the same fake GPU and versions as the
    # workers'): nothing is left for a worker to do.
    monkeypatch.setattr(runtime, "_core", lambda: fake_core)
    runtime.clear()
    monkeypatch.setattr(warm, "_Worker", lambda *a, **k: pytest.fail("a worker was started"))
    seen = []
    again = warm.warm(configs, workers=2, progress=lambda done, total, item: seen.append(done))
    assert again.counts == {"built": 0, "loaded": 2, "unsupported": 1, "failed": 0}
    assert "1024" in again.items[2].reason and again.items[0].forward_engine == "fake_fwd"
    s = runtime.stats()
    assert seen == [1, 2, 3] and s["builds"] == 0 and s["deserializations"] == 0
    runtime.clear()


def test_workers_keep_to_a_kernel_family():
    a, b = cfgs(128, 256, 384), cfgs(128, 256, head_dim_qk=128)
    q = warm._Queue([warm.WarmItem(c) for c in a + b])
    assert q.take(0).config == a[0]  # the largest family first, in the given order
    assert q.take(1).config == b[0]  # a new worker takes the family nobody has
    assert q.take(2) is None  # too little left to be worth compiling a family twice
    assert [q.take(0).config, q.take(0).config] == a[1:]
    assert q.take(0) is None  # its family is done; the other is worker 1's
    assert q.take(1).config == b[1] and len(q) == 0


def test_a_big_family_is_shared_and_a_lost_worker_frees_its_family():
    big = cfgs(*range(64, 64 + 2 * warm._Queue.STEAL_AT + 2))
    q = warm._Queue([warm.WarmItem(c) for c in big])
    assert q.take(0) and q.take(1) and q.take(2)  # 2S+1 left for 1 worker, then 2S for 2: shared
    assert q.take(3) is None  # 2S-1 for 3: not worth another compile
    q.forget(0), q.forget(1), q.forget(2)
    assert q.take(3) is not None  # nobody has the family now


class _ScanningQueue:
    """_Queue's policy as it was written first, scanning every family on each take: the
    reference the heap-based _Queue must agree with."""

    def __init__(self, items, family):
        self.groups, self.STEAL_AT = {}, warm._Queue.STEAL_AT
        for item in reversed(items):
            self.groups.setdefault(family(item.config), []).append(item)
        self.owners = {g: set() for g in self.groups}

    def take(self, worker):
        mine = [g for g, owners in self.owners.items() if worker in owners and self.groups[g]]
        if not mine:
            left = [g for g in self.groups if self.groups[g]]
            fresh = [g for g in left if not self.owners[g]]
            if fresh:
                mine = [max(fresh, key=lambda g: len(self.groups[g]))]
            elif left:
                g = max(left, key=lambda g: len(self.groups[g]) / len(self.owners[g]))
                if len(self.groups[g]) / len(self.owners[g]) >= self.STEAL_AT:
                    mine = [g]
            if not mine:
                return None
            self.owners[mine[0]].add(worker)
        return self.groups[mine[0]].pop()

    def forget(self, worker):
        for owners in self.owners.values():
            owners.discard(worker)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(families=st.lists(st.integers(0, 5), min_size=0, max_size=80),
       ops=st.lists(st.tuples(st.sampled_from(["take", "take", "take", "forget"]), st.integers(0, 4)), max_size=200))
def test_the_queue_hands_out_what_the_scanning_policy_does(monkeypatch, families, ops):
    # Each config's family is its listed number; any order of takes and lost workers.
    configs = [AttentionConfig(batch=1, heads_q=8, head_dim_qk=64, seqlen_q=64 + i) for i in range(len(families))]
    family = {c: (f,) for c, f in zip(configs, families)}
    monkeypatch.setattr(warm, "kernel_family", lambda c: family[c])
    q = warm._Queue([warm.WarmItem(c) for c in configs])
    ref = _ScanningQueue([warm.WarmItem(c) for c in configs], family.__getitem__)
    for op, worker in ops:
        if op == "forget":
            q.forget(worker), ref.forget(worker)
            continue
        got, want = q.take(worker), ref.take(worker)
        assert (got and got.config) == (want and want.config)
    assert len(q) == sum(len(v) for v in ref.groups.values())


def test_warm_starts_no_more_workers_than_families(fake_workers):
    report = warm.warm(cfgs(128, 256, 384, 512), workers=4)
    assert report.counts["built"] == 4 and report.processes == 1
    report = warm.warm(cfgs(640, 768) + cfgs(640, 768, head_dim_qk=128), workers=4)
    assert report.counts["built"] == 4 and report.processes == 2
