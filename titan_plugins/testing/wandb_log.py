"""Read what a W&B sink wrote in offline mode, for tests of sinks: :func:`wandb_records`
parses a run's transaction log (``offline-run-*/run-*.wandb``) without wandb's service.
Needs ``wandb`` (its protobuf messages), imported on use."""

from __future__ import annotations

import struct
from pathlib import Path

__all__ = ["wandb_records"]


def wandb_records(run_file: Path) -> list:
    """The records of a W&B offline transaction log (LevelDB log blocks after a 7-byte
    ':W&B' header; each record a wandb_internal_pb2.Record)."""
    from wandb.proto import wandb_internal_pb2 as pb

    buf = Path(run_file).read_bytes()
    assert buf[:4] == b":W&B", f"{run_file} is not a W&B transaction log"
    block, pos, pending, out = 32768, 7, b"", []
    while pos + 7 <= len(buf):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", buf[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        data, pos = buf[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:  # full
            out.append(data)
        elif kind in (2, 3):  # first, middle
            pending += data
        elif kind == 4:  # last
            out.append(pending + data)
            pending = b""
    records = []
    for data in out:
        rec = pb.Record()
        rec.ParseFromString(data)
        records.append(rec)
    return records
