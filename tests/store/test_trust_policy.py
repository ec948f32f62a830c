"""One trust policy for what comes from elsewhere, the Redis tier and bundles alike
(store.signing.Policy): with a secret, what it signs ("signed and checked"); without
one, anything when FASTATTN_CACHE_TRUSTED=1 says so ("unsigned, trusted by
FASTATTN_CACHE_TRUSTED=1"); without either, nothing. `cache import` and `cache pull`
print which applied. And `cache import` into a directory that keeps nothing
(FASTATTN_CACHE_MAX_BYTES) reports what it did not keep, exit 4, as `warm` does.

cuDNN is tests/fake_core.py.
"""

from __future__ import annotations

import itertools
import json

import pytest

import fastattn
from fastattn import cli, env as env_mod, runtime, store
from fastattn.store import bundle, signing
from fastattn.store.keys import key_of
from fastattn.store.remote import RemoteSettings, RemoteStore

from helpers.cli import run
from helpers.paths import ENVIRONMENT
from helpers.redis import FakeRedis

BASE = dict(batch=1, heads_q=8, head_dim_qk=64, mask="causal")
SECRETS = {None: None, "A": b"secret A", "B": b"secret B"}


def entry() -> store.Entry:
    described = {"config": {"batch": 1}}
    return store.Entry(key_of(described), "plan", described, {"forward": b"plan" * 50}, {"forward_engine": "e"}, 1.0)


def redis_takes(signer, here, trusted) -> bool:
    e = entry()
    value = signing.wrap(SECRETS[signer], e.key, store.entry.encode(e))
    r = RemoteStore(RemoteSettings("redis://localhost:1/0", trusted=trusted), SECRETS[here])
    r._client, r._errors = FakeRedis({"fastattn:" + e.key: value}), (OSError,)
    return r.get(e.key) is not None


def bundle_takes(tmp_path, signer, here, trusted) -> bool:
    src = store.DiskStore(str(tmp_path / "src"))
    src.put(entry())
    path = str(tmp_path / f"b-{signer}.tgz")
    bundle.export_bundle([src], path, secret=SECRETS[signer])
    dst = store.DiskStore(str(tmp_path / f"dst-{signer}-{here}-{trusted}"))
    kw = {"trusted": True} if trusted else {}
    try:
        report = bundle.import_bundle(path, dst, environment=None, force=True, secret=SECRETS[here], **kw)
    except fastattn.InvalidArgumentError:
        assert list(dst.entries()) == []
        return False
    assert report.imported == 1
    return True


@pytest.mark.parametrize("signer,here,trusted", list(itertools.product([None, "A"], [None, "A", "B"], [False, True])))
def test_redis_and_bundles_take_the_same(tmp_path, signer, here, trusted):
    expected = (here is None and trusted) or (here is not None and here == signer)
    assert redis_takes(signer, here, trusted) == expected
    assert bundle_takes(tmp_path, signer, here, trusted) == expected


def test_one_variable_states_trust_for_both():
    assert signing.TRUST_VARIABLE in env_mod.VARIABLES
    assert [name for name in env_mod.VARIABLES if name.endswith("_TRUSTED")] == [signing.TRUST_VARIABLE]
    assert env_mod.markdown() in ENVIRONMENT.read_text()


# -- through the command ---------------------------------------------------------------------


def fill(n=3):
    for s in range(n):
        fastattn.plan({**BASE, "seqlen_q": 128 * (s + 1)})


def new_process(cache_dir, monkeypatch, **variables):
    for name in ("FASTATTN_CACHE_HMAC_KEY", "FASTATTN_CACHE_HMAC_KEY_FILE", "FASTATTN_CACHE_TRUSTED",
                 "FASTATTN_CACHE_MAX_BYTES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("FASTATTN_CACHE_DIR", str(cache_dir))
    runtime.clear()


def exported(env, capsys, monkeypatch, **variables) -> str:
    new_process(env / "cache", monkeypatch, **variables)
    fill()
    path = str(env / "b.tgz")
    code, out, err = run(["cache", "export", "--force", path], capsys)
    assert code == 0, err
    assert ("(signed)" if variables else "(unsigned)") in out
    return path


def test_an_unsigned_bundle_is_refused_unless_trust_is_stated(env, capsys, monkeypatch):
    path = exported(env, capsys, monkeypatch)
    new_process(env / "other", monkeypatch)
    code, out, err = run(["cache", "import", "--force", path], capsys)
    assert code == cli.EXIT_BAD_INPUT, out + err
    assert "refusing bundle: it is not signed" in err and "FASTATTN_CACHE_TRUSTED=1" in err
    assert "loading a plan loads native code" in err
    new_process(env / "other", monkeypatch, FASTATTN_CACHE_TRUSTED="1")
    code, out, err = run(["cache", "import", "--force", path], capsys)
    assert code == 0 and "imported 3 entries" in out and "unsigned, trusted by FASTATTN_CACHE_TRUSTED=1" in out
    new_process(env / "third", monkeypatch, FASTATTN_CACHE_HMAC_KEY="s3cret", FASTATTN_CACHE_TRUSTED="1")
    code, out, err = run(["cache", "import", "--force", path], capsys)
    assert code == cli.EXIT_BAD_INPUT and "not signed, and a signing secret is set" in err


def test_a_signed_bundle_without_a_secret_to_check_it_is_refused_unless_trust_is_stated(env, capsys, monkeypatch):
    path = exported(env, capsys, monkeypatch, FASTATTN_CACHE_HMAC_KEY="s3cret")
    new_process(env / "other", monkeypatch)
    code, out, err = run(["cache", "import", "--force", path], capsys)
    assert code == cli.EXIT_BAD_INPUT and "it is signed, and no signing secret" in err, err
    new_process(env / "other", monkeypatch, FASTATTN_CACHE_TRUSTED="1")
    code, out, err = run(["cache", "import", "--force", path], capsys)
    assert code == 0 and "signed, unchecked (no secret here), trusted by FASTATTN_CACHE_TRUSTED=1" in out
    new_process(env / "third", monkeypatch, FASTATTN_CACHE_HMAC_KEY="s3cret")
    code, body = run_json(["cache", "import", "--force", path], capsys)
    assert code == 0 and body["imported"] == 3 and body["policy"] == "signed and checked"


def test_a_bad_trust_value_names_the_variable(env, capsys, monkeypatch):
    path = exported(env, capsys, monkeypatch)
    new_process(env / "other", monkeypatch, FASTATTN_CACHE_TRUSTED="maybe")
    code, out, err = run(["cache", "import", "--force", path], capsys)
    assert code == cli.EXIT_BAD_INPUT and "FASTATTN_CACHE_TRUSTED='maybe'" in err


def run_json(argv, capsys):
    code, out, err = run(argv + ["--json"], capsys)
    return code, json.loads(out)


def test_import_into_a_cache_that_keeps_nothing_reports_it_exit_4(env, capsys, monkeypatch):
    path = exported(env, capsys, monkeypatch)
    new_process(env / "other", monkeypatch, FASTATTN_CACHE_TRUSTED="1", FASTATTN_CACHE_MAX_BYTES="1")
    code, out, err = run(["cache", "import", "--force", path], capsys)
    assert code == cli.EXIT_FAILED, out + err
    assert "not kept: 3 of the bundle's 3 entries" in err and "FASTATTN_CACHE_MAX_BYTES=1" in err
    code, body = run_json(["cache", "import", "--force", path], capsys)
    assert code == cli.EXIT_FAILED and body["not_kept"] == 3 and "FASTATTN_CACHE_MAX_BYTES" in body["not_kept_reason"]
    assert run_json(["cache", "ls"], capsys)[1]["entries"] == []
    new_process(env / "third", monkeypatch, FASTATTN_CACHE_TRUSTED="1")
    code, body = run_json(["cache", "import", "--force", path], capsys)
    assert code == 0 and body["imported"] == 3 and body["not_kept"] == 0
