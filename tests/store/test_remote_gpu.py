"""GPU: a machine with an empty disk cache starts warm from the Redis tier, with real
cuDNN plans (redis-server and the redis client needed, as for test_remote.py)."""

from helpers.redis import start_server
from helpers.cache_worker import CONFIGS, result, worker


def test_a_fresh_machine_starts_warm_from_redis_bitwise_identical(tmp_path, monkeypatch):
    server = start_server(tmp_path)
    try:
        monkeypatch.setenv("FASTATTN_REMOTE_CACHE", server.url)
        monkeypatch.setenv("FASTATTN_CACHE_HMAC_KEY", "a fleet secret")
        a = result(worker(tmp_path / "machine-a"))
        assert a["builds"] == len(CONFIGS) and a["remote_hits"] == 0
        assert server.client().dbsize() == len(CONFIGS)
        b = result(worker(tmp_path / "machine-b"))
        assert b["builds"] == 0 and b["remote_hits"] == len(CONFIGS) and b["deserializations"] == len(CONFIGS)
        assert b["hashes"] == a["hashes"]
    finally:
        server.stop()
