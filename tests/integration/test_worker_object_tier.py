"""One real worker process whose object tier (G4) is the stack's SeaweedFS, signed with the stack's
key from its credentials file (as the demo's workers are): blocks pushed below a 4-block host tier
land in the bucket under the worker's prefix, and the worker's next incarnation reads each back
and verifies it. A worker given a wrong secret key refuses to start, saying why."""

from __future__ import annotations

import uuid

import openai
import pytest

from ops.stack.seaweedfs import SeaweedService
from data_plane.kvbm.stores.s3 import make_client
from common.settings import BusSettings, write_private
from tests.integration.workerproc import WorkerProc
from tests.support.waits import wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(120)]

BS = 16


def _args(seaweedfs: SeaweedService, bucket: str, credentials: str) -> tuple[str, ...]:
    # 10 device blocks, 4 host blocks: each 9-block prompt evicts everything before it from the
    # device, and the host tier keeps only the last 4 blocks evicted: the others go on down to
    # the object tier.
    return ("--speedup", "20", "--block-size", str(BS), "--device-blocks", "10", "--host-blocks", "4",
            "--object-blocks", "64", "--s3-endpoint", seaweedfs.s.s3_endpoint, "--s3-bucket", bucket,
            "--s3-credentials-file", credentials, "--load-interval", "0.3")


@pytest.fixture
def bucket(seaweedfs: SeaweedService):
    name = f"w-{uuid.uuid4().hex[:12]}"
    yield name
    client = make_client(seaweedfs.s3_settings(name))
    try:
        client.delete_bucket(Bucket=name)  # with its objects
    except client.exceptions.NoSuchBucket:
        pass  # the worker never made it
    finally:
        client.close()


def test_blocks_below_host_land_in_seaweedfs_and_are_served_back(seaweedfs: SeaweedService, bucket: str,
                                                                  bus: BusSettings, tmp_path) -> None:
    w = WorkerProc(bus, "w-g4", tmp_path / "data", tmp_path,
                   args=_args(seaweedfs, bucket, str(seaweedfs.s.s3_credentials_file))).start()
    try:
        client = openai.OpenAI(base_url=f"{w.url}/v1", api_key=w.token(), max_retries=0)
        prompt_a = list(range(500, 564))  # 4 full blocks
        for prompt in (prompt_a, list(range(1000, 1144)), list(range(2000, 2144))):  # then 9 and 9
            client.completions.create(model="switchyard-sim", prompt=prompt, max_tokens=2)

        def in_object() -> list[int]:
            return sorted(w.state()["tiers"]["object"])

        wait_for(lambda: len(in_object()) >= 4, 15, "blocks demoted below host to the object tier")
        s3 = make_client(seaweedfs.s3_settings(bucket))
        prefix = "switchyard/kvbm/w-g4/"
        keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []))
        assert keys == [f"{prefix}{h:016x}.kvb" for h in in_object()]

        # A new incarnation (kill -9, same id, data dir and bucket) reads every block the log says
        # is in the bucket back from it, verifies it, and serves them again.
        w.kill()
        w.start()
        assert f"rebuilt object: {len(keys)} verified, 0 missing, 0 corrupt" in w.log(), w.log()
        assert sorted(w.state()["tiers"]["object"]) == [int(k[len(prefix):-4], 16) for k in keys]
    finally:
        w.kill()


def test_a_wrong_secret_key_is_refused_at_start_with_the_reason(seaweedfs: SeaweedService, bucket: str,
                                                                 bus: BusSettings, tmp_path) -> None:
    creds = tmp_path / "wrong-credentials"
    write_private(creds, "[default]\naws_access_key_id = switchyard\naws_secret_access_key = not-the-key\n")
    w = WorkerProc(bus, "w-g4-bad", tmp_path / "data", tmp_path, args=_args(seaweedfs, bucket, str(creds)))
    with pytest.raises(AssertionError, match="exited with") as e:
        w.start()
    said = w.log()
    assert f"error: worker w-g4-bad: a KV tier's storage failed: bucket {bucket}:" in said, said
    assert "403" in said and "Traceback" not in said, said
