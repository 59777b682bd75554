"""Client API keys (hashed at rest), per-key rate and concurrency limits, security
headers and CORS, on HTTP and gRPC against a real Serve app (null engine)."""

import grpc
import httpx
import pytest
from ray import serve

from serve_app.auth import KeyStore, hash_key, parse_key_lines
from serve_app.errors import OverloadedError, UnauthorizedError
from serve_app.protos import seekserve_pb2 as pb
from serve_app.protos import seekserve_pb2_grpc as pb_grpc
from tests.conftest import deploy_app, null_config


def store(rate=1.0, burst=2, conc=2):
    return KeyStore(parse_key_lines(f"alice:{hash_key('a-secret')}\nbob:{hash_key('b-secret')}"), rate, burst, conc)


def test_keys_are_hashed_and_checked():
    ks = store()
    assert ks.authenticate("Bearer a-secret") == "alice"
    assert ks.authenticate("bearer b-secret") == "bob"
    assert "a-secret" not in repr(ks.keys)  # only digests are held
    for bad in (None, "", "Basic a-secret", "Bearer nope", "Bearer a-secret2"):
        with pytest.raises(UnauthorizedError):
            ks.authenticate(bad)


def test_key_file_format_errors():
    with pytest.raises(ValueError, match="64 hex"):
        parse_key_lines("alice:abc")
    with pytest.raises(ValueError, match="name:"):
        parse_key_lines(hash_key("x"))
    assert parse_key_lines("# comment\n\n") == {}


def test_rate_limit_token_bucket_with_injected_time():
    ks = store(rate=1.0, burst=2, conc=100)
    ks.acquire("alice", now=0.0)
    ks.acquire("alice", now=0.0)
    with pytest.raises(OverloadedError) as e:
        ks.acquire("alice", now=0.1)
    assert e.value.code == "rate_limit" and 0.8 < e.value.retry_after_s <= 0.9
    ks.acquire("bob", now=0.1)  # limits are per key
    ks.acquire("alice", now=1.2)  # refilled


def test_concurrency_cap_and_release():
    ks = store(rate=100, burst=100, conc=2)
    ks.acquire("alice", now=0.0)
    ks.acquire("alice", now=0.0)
    with pytest.raises(OverloadedError) as e:
        ks.acquire("alice", now=0.0)
    assert e.value.code == "concurrency_limit"
    ks.release("alice")
    ks.acquire("alice", now=0.0)


def test_limits_are_shared_out_over_ingress_replicas():
    from serve_app.config import AuthSettings, ConfigError, parse_config

    s = AuthSettings(mode="api_keys", api_keys_env="X", rate_limit_per_s=10, burst=5, max_concurrent_per_key=9)
    ks = KeyStore.from_settings(s, replicas=2)
    assert (ks.rate_per_s, ks.burst, ks.max_concurrent) == (5.0, 2, 4)
    cfg = null_config("m")
    cfg["auth"] = {"mode": "api_keys", "burst": 2, "max_concurrent_per_key": 8}
    cfg["server"] = {"ingress_replicas": 3}
    with pytest.raises(ConfigError, match=r"burst \(2\) and max_concurrent_per_key \(8\) must be at least 3"):
        parse_config(cfg)


def keyed_app(tmp_path_factory, name, key_line, num_tokens, server=None, **limits):
    """Deploy a null-engine app (model = app = route name) that needs the one key in ``key_line``."""
    keyfile = tmp_path_factory.mktemp(f"keys-{name}") / "api_keys"
    keyfile.write_text(key_line + "\n")
    cfg = null_config(name, num_tokens=num_tokens)
    cfg["auth"] = {"mode": "api_keys", "api_keys_file": str(keyfile), "api_keys_env": None, **limits}
    if server:
        cfg["server"] = server
    deploy_app(cfg, name=name, route_prefix=f"/{name}")


@pytest.fixture(scope="module")
def secured(serve_session, tmp_path_factory):
    keyed_app(tmp_path_factory, "guarded", f"alice:{hash_key('a-secret')}", 4,
              rate_limit_per_s=0.2, burst=3, max_concurrent_per_key=8)
    yield {"base": serve_session["base"] + "/guarded", "grpc": f"127.0.0.1:{serve_session['grpc_port']}"}
    serve.delete("guarded")


BODY = {"model": "guarded", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_http_needs_a_valid_key_and_limits_it(secured):
    url = secured["base"] + "/v1/chat/completions"
    r = httpx.post(url, json=BODY)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.post(url, json=BODY, headers={"Authorization": "Bearer wrong"}).status_code == 401
    codes = [httpx.post(url, json=BODY, headers={"Authorization": "Bearer a-secret"}, timeout=30).status_code
             for _ in range(4)]
    assert codes[:3] == [200, 200, 200] and codes[3] == 429  # burst 3, then 0.2 requests/s
    r = httpx.post(url, json=BODY, headers={"Authorization": "Bearer a-secret"})
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["code"] == "rate_limit"
    # models and health stay open; inference does not
    assert httpx.get(secured["base"] + "/v1/models").status_code == 200


def test_security_headers_and_no_cors(secured):
    r = httpx.get(secured["base"] + "/v1/models")
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["x-frame-options"] == "DENY" and r.headers["cache-control"] == "no-store"
    pre = httpx.options(secured["base"] + "/v1/chat/completions",
                        headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in pre.headers


def test_grpc_needs_a_valid_key(secured):
    with grpc.insecure_channel(secured["grpc"]) as ch:
        stub = pb_grpc.InferenceStub(ch)
        req = pb.GenerateRequest(model="guarded", messages=[pb.ChatMessage(role="user", content="hi")], max_tokens=2)
        md = [("application", "guarded")]
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(req, metadata=md, timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(req, metadata=md + [("authorization", "Bearer wrong")], timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # the HTTP test used the burst; wait for one token at 0.2/s
        import time

        time.sleep(5.5)
        r = stub.Generate(req, metadata=md + [("authorization", "Bearer a-secret")], timeout=30)
        assert r.usage.completion_tokens == 2


@pytest.fixture(scope="module")
def two_ingresses(serve_session, tmp_path_factory):
    # a bucket that does not refill during the test: a key gets its burst in total
    keyed_app(tmp_path_factory, "shared", f"carol:{hash_key('c-secret')}", 2, server={"ingress_replicas": 2},
              rate_limit_per_s=0.001, burst=4, max_concurrent_per_key=8)
    yield serve_session["base"] + "/shared"
    serve.delete("shared")


def test_a_keys_burst_holds_across_two_ingress_replicas(two_ingresses):
    body = {"model": "shared", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    codes = [httpx.post(two_ingresses + "/v1/chat/completions", json=body, timeout=30,
                        headers={"Authorization": "Bearer c-secret"}).status_code for _ in range(16)]
    assert set(codes) == {200, 429}, codes
    # each replica's share is 2: at most 4 in total, not 4 per replica
    assert 2 <= codes.count(200) <= 4, codes
