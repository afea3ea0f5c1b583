"""The stack's SeaweedFS (ops/stack/seaweedfs.py), as a client on this box sees it: the
S3 API answers the stack's key only, the other HTTP APIs are off or want a JWT, every gRPC port
wants a client certificate from the stack's SeaweedFS CA, and every port it listens on is one of
the stack's, on loopback."""

from __future__ import annotations

import socket
import ssl
import uuid
from pathlib import Path

import boto3
import httpx
import pytest
from botocore import UNSIGNED
from botocore.config import Config
from botocore.exceptions import ClientError

from common.stack_settings import S3_ACCESS_KEY
from ops.stack.process import descendants, listening_sockets
from ops.stack.seaweedfs import SeaweedService
from ops.stack.tls import GrpcTls, ensure_seaweedfs_tls
from data_plane.kvbm.stores.s3 import make_client


def _client(endpoint: str, **credentials):
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1},
                                      **({} if credentials else {"signature_version": UNSIGNED})),
                        **credentials)


@pytest.fixture
def bucket(seaweedfs: SeaweedService):
    """A bucket of this test's own, holding one object ``k``; dropped after the test."""
    name = f"sw-{uuid.uuid4().hex[:12]}"
    owner = make_client(seaweedfs.s3_settings(name))
    owner.create_bucket(Bucket=name)
    owner.put_object(Bucket=name, Key="k", Body=b"kv block")
    yield name
    owner.delete_bucket(Bucket=name)  # SeaweedFS deletes a bucket with its objects
    owner.close()


def test_s3_answers_the_stacks_key_and_refuses_everyone_else(seaweedfs: SeaweedService, bucket: str) -> None:
    endpoint, secret = seaweedfs.s.s3_endpoint, seaweedfs.s.s3_secret_key
    owner = _client(endpoint, aws_access_key_id=S3_ACCESS_KEY, aws_secret_access_key=secret)
    assert owner.get_object(Bucket=bucket, Key="k")["Body"].read() == b"kv block"

    strangers = {
        "unsigned": _client(endpoint),
        "a wrong secret": _client(endpoint, aws_access_key_id=S3_ACCESS_KEY, aws_secret_access_key=secret + "x"),
        "an unknown key id": _client(endpoint, aws_access_key_id="intruder", aws_secret_access_key=secret),
    }
    for who, client in strangers.items():
        for what, call in (("read", lambda: client.get_object(Bucket=bucket, Key="k")),
                           ("write", lambda: client.put_object(Bucket=bucket, Key="k", Body=b"forged")),
                           ("list", lambda: client.list_objects_v2(Bucket=bucket)),
                           ("delete", lambda: client.delete_object(Bucket=bucket, Key="k")),
                           ("make a bucket", lambda: client.create_bucket(Bucket=f"sw-{uuid.uuid4().hex[:12]}"))):
            with pytest.raises(ClientError) as e:
                call()
            status = e.value.response["ResponseMetadata"]["HTTPStatusCode"]
            assert status == 403, f"{what} by {who}: {status} {e.value.response['Error']}"
    # Nothing they tried got through.
    assert owner.get_object(Bucket=bucket, Key="k")["Body"].read() == b"kv block"
    assert [b["Name"] for b in owner.list_buckets()["Buckets"] if b["Name"] == bucket] == [bucket]


def test_no_http_api_but_s3_serves_without_a_credential(seaweedfs: SeaweedService, bucket: str) -> None:
    """The master's and filer's HTTP APIs (which take no credential: the master's /col/delete
    drops a bucket's volumes) are off; the volume server's wants a JWT for reads and writes."""
    host, ports = seaweedfs.s.host, seaweedfs.s.seaweedfs_ports
    master, filer, volume = (f"http://{host}:{ports[f]}" for f in ("master.port", "filer.port", "volume.port"))
    assert httpx.get(f"{master}/col/delete", params={"collection": bucket}).status_code == 404
    assert httpx.get(f"{master}/dir/assign").status_code == 404
    assert httpx.get(f"{filer}/buckets/{bucket}/k").status_code == 404
    assert httpx.post(f"{filer}/buckets/{bucket}/forged", files={"file": b"x"}).status_code == 404
    assert httpx.get(f"{volume}/1,01637037d6").status_code == 401
    assert httpx.post(f"{volume}/1,01637037d6", files={"file": b"x"}).status_code == 401
    owner = make_client(seaweedfs.s3_settings(bucket))
    assert owner.get_object(Bucket=bucket, Key="k")["Body"].read() == b"kv block"


def test_it_listens_on_its_own_ports_only_all_on_loopback(seaweedfs: SeaweedService) -> None:
    pid = seaweedfs.pid()
    assert pid, f"no live pid in {seaweedfs.pid_file}"
    found = listening_sockets(descendants([pid]))
    assert found and all(x.loopback for x in found), [x for x in found if not x.loopback]
    assert {x.port for x in found if x.proto.startswith("tcp")} == set(seaweedfs.s.seaweedfs_ports.values())
    assert not [x for x in found if x.proto.startswith("udp")]
    args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    assert "-master.telemetry=false" in args and "-disableHttp" in args


#: The first bytes of an HTTP/2 connection: a client's preface, and the server's SETTINGS frame
#: header (length 0x18, type 4, no flags, stream 0) it answers with.
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
H2_SETTINGS = bytes.fromhex("000018040000000000")


def _h2_over_tls(port: int, ca: GrpcTls, client: GrpcTls | None) -> bytes:
    ctx = ssl.create_default_context(cafile=str(ca.ca_file))
    ctx.set_alpn_protocols(["h2"])
    if client:
        ctx.load_cert_chain(str(client.cert_file), str(client.key_file))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        tls.sendall(H2_PREFACE)
        return tls.recv(9)


def test_grpc_wants_a_client_certificate_from_the_stacks_seaweedfs_ca(seaweedfs: SeaweedService, tmp_path) -> None:
    """Without a client certificate, or with one from another CA, every gRPC server refuses the
    handshake; in clear text it says nothing. With the stack's own it answers HTTP/2 (gRPC)."""
    own = ensure_seaweedfs_tls(seaweedfs.s.secrets_dir, seaweedfs.s.host)
    stranger = ensure_seaweedfs_tls(tmp_path / "elsewhere")
    grpc_ports = [p for flag, p in seaweedfs.s.seaweedfs_ports.items() if flag.endswith(".grpc")]
    assert len(grpc_ports) == 5  # S3, master, volume, filer, admin
    for port in grpc_ports:
        assert _h2_over_tls(port, own, own) == H2_SETTINGS, port
        for client in (None, stranger):
            with pytest.raises((ssl.SSLError, ConnectionError)):
                _h2_over_tls(port, own, client)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            raw.sendall(H2_PREFACE + bytes.fromhex("000000040000000000"))  # an empty SETTINGS frame
            assert raw.recv(64) == b"", port
