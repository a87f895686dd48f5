"""Version 1's vocabulary: bounds, scalar types and Literals every v1 message shares, and the
three base Structs (strict commands, nested parts, lenient replies).
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Struct

# -- bounds ------------------------------------------------------------------------------------
# Sane maxima: far above any real machine, low enough that arithmetic on sums never surprises.

MAX_CPU_MILLIS = 1_024_000  # 1024 cores
MAX_MEMORY_MIB = 16 * 1024 * 1024  # 16 TiB
MAX_GPU_COUNT = 64
MAX_GPU_MEMORY_GIB = 1024
MAX_LOCAL_DISK_GIB = 1_000_000
MAX_BANDWIDTH_MBPS = 1_000_000  # 1 Tbit/s
MAX_RUNTIME_SECONDS = 30 * 24 * 3600  # 30 days
MAX_PREFERENCES = 16
MAX_IMAGE_SIZE_BYTES = 1 << 40  # 1 TiB
MAX_LEASES_PER_REQUEST = 999  # one event each: one atomic batch holds at most 1,000
MAX_WORKDIR_BYTES = 1 << 40  # 1 TiB: the most any pool may set as its workdir limit
# a job's output kept on its node and shipped to its tenant (pool setting max_output_bytes)
OutputBytes = Annotated[int, Meta(ge=0, le=1 << 34)]
MAX_ARTIFACT_GLOBS = 32

CURRENT_SCHEMA_VERSION = 1

# -- scalar vocabulary -------------------------------------------------------------------------
# Patterns end in (?!\n)$ because msgspec matches with Python's re, where a bare $ also matches
# before a trailing newline ("gpu\n" would pass as a subject token); ECMA readers of the exported
# JSON Schema accept the lookahead too.

# A reader accepts the versions it knows; a body from a newer writer is refused, not guessed at.
SchemaVersion = Annotated[
    int,
    Meta(ge=1, le=CURRENT_SCHEMA_VERSION, description="Wire schema version of this message."),
]

# Ids that become NATS subject tokens: exactly bus.subjects' token alphabet, so that
# `token(id) == id` and no two ids share a subject.
SubjectToken = Annotated[
    str, Meta(pattern=r"^[a-z0-9_-]{1,128}(?!\n)$", min_length=1, max_length=128)
]
# Names chosen by operators (priority classes, regions, zones): subject-safe as well.
NameToken = Annotated[str, Meta(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}(?!\n)$", max_length=63)]
# Client-chosen keys that never become subjects: a wider but still printable alphabet.
IdempotencyKey = Annotated[
    str,
    Meta(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}(?!\n)$",
        min_length=1,
        max_length=128,
        description="Client-chosen key; a retry with the same key returns the same lease.",
    ),
]
# NVML names contain spaces and parentheses ("NVIDIA H100 80GB HBM3"), so printable ASCII.
GpuModel = Annotated[str, Meta(pattern=r"^[A-Za-z0-9][ -~]{0,127}(?!\n)$", max_length=128)]
ImageRef = Annotated[
    str,
    Meta(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,511}(?!\n)$",
        max_length=512,
        description="OCI image reference; a digest (`@sha256:...`) pins it immutably.",
    ),
]
ImageSignature = Annotated[
    str,
    Meta(
        pattern=r"^[A-Za-z0-9+/]{4,2048}={0,2}(?!\n)$",
        max_length=2050,
        description="Base64 signature over the image's cosign simple-signing payload "
        "(DER ECDSA P-256/SHA-256, or raw Ed25519).",
    ),
]
ImageSizeBytes = Annotated[
    int,
    Meta(ge=0, le=MAX_IMAGE_SIZE_BYTES, description="Image size in bytes, as declared by the job."),
]
# `*`, a registry `host[:port]`, or `host[:port]/repository-prefix`.
RegistryPattern = Annotated[
    str,
    Meta(
        pattern=r"^(\*|[a-z0-9]([a-z0-9.-]{0,252}[a-z0-9])?(:[0-9]{1,5})?"
        r"(/[a-z0-9._-]{1,128}){0,16})(?!\n)$",
        max_length=512,
    ),
]
PublicKeyPem = Annotated[
    str,
    Meta(
        pattern=r"^-----BEGIN PUBLIC KEY-----\r?\n([A-Za-z0-9+/=]{1,80}\r?\n){1,64}"
        r"-----END PUBLIC KEY-----(\r?\n)?(?!\n)$",
        max_length=8192,
        description="PEM SubjectPublicKeyInfo: an ECDSA P-256 or Ed25519 public key.",
    ),
]
# a packed work directory's name in the tenant's bucket: the SHA-256 of its bytes
WorkdirDigest = Annotated[
    str,
    Meta(pattern=r"^sha256:[0-9a-f]{64}(?!\n)$", max_length=71,
         description="SHA-256 of the packed work directory (a tar), as `sha256:<hex>`."),
]
# relative to /work; no control characters, no leading `/`
ArtifactGlob = Annotated[
    str,
    Meta(pattern=r"^[^/\x00-\x1f\x7f][^\x00-\x1f\x7f]{0,255}(?!\n)$", max_length=256,
         description="A glob of files, relative to /work, stored as artifacts at the job's end."),
]
EnvName = Annotated[str, Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}(?!\n)$", max_length=128)]
# a tenant's secret (schemas/secret.py); its value never travels in a job, only its name
SecretName = Annotated[
    str,
    Meta(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}(?!\n)$", max_length=63,
         description="A secret's name: 1-63 of a-z 0-9 _ -, starting with a letter or digit."),
]
# where a secret's file appears in the sandbox: always in the tmpfs the agent makes there
SecretPath = Annotated[
    str,
    Meta(pattern=r"^/run/secrets/(?!\.\.?$)[A-Za-z0-9._-]{1,128}(?!\n)$", max_length=141,
         description="A file under /run/secrets (in memory, wiped at the job's end)."),
]
MAX_JOB_SECRETS = 32
EnvValue = Annotated[str, Meta(max_length=4096)]
Argument = Annotated[str, Meta(max_length=4096)]
Command = Annotated[list[Argument], Meta(max_length=256)]
Environment = Annotated[dict[EnvName, EnvValue], Meta(max_length=128)]
Reason = Annotated[str, Meta(max_length=512)]
ShortText = Annotated[str, Meta(max_length=256)]
Count = Annotated[int, Meta(ge=0, le=2**53)]  # sequence numbers, epochs, quota amounts
LabelKey = Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_./-]{0,62}(?!\n)$", max_length=63)]
LabelValue = Annotated[str, Meta(max_length=256)]
# a lease's name: what its tenant calls it (not unique; lists are filtered by it)
LeaseName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}(?!\n)$",
                                max_length=63)]
MAX_LEASE_LABELS = 16
UnixSeconds = Annotated[float, Meta(ge=0, le=1e11, description="Seconds since the Unix epoch.")]

CpuMillis = Annotated[int, Meta(ge=0, le=MAX_CPU_MILLIS, description="1000 = one CPU core.")]
MemoryMib = Annotated[int, Meta(ge=0, le=MAX_MEMORY_MIB)]
GpuCount = Annotated[int, Meta(ge=0, le=MAX_GPU_COUNT)]
GpuMemoryGib = Annotated[int, Meta(ge=0, le=MAX_GPU_MEMORY_GIB)]
# a GPU or MIG UUID as NVML spells it, or "<gpu uuid>/ts<k>" for a time-slice replica
DeviceId = Annotated[
    str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9:._-]{0,119}(/ts[0-9]{1,2})?(?!\n)$",
              max_length=128)
]
MAX_DEVICES = 1024  # MIG instances and replicas included
LocalDiskGib = Annotated[int, Meta(ge=0, le=MAX_LOCAL_DISK_GIB)]
BandwidthMbps = Annotated[int, Meta(ge=0, le=MAX_BANDWIDTH_MBPS)]
RuntimeSeconds = Annotated[int, Meta(ge=1, le=MAX_RUNTIME_SECONDS)]

# A MIG profile ("1g.10gb", "7g.80gb") or "time-slice": each is its own extended dimension.
MIG_PROFILE_PATTERN = r"[1-7]g\.[1-9][0-9]{0,3}gb"
PartitionProfile = Annotated[
    str, Meta(pattern=rf"^({MIG_PROFILE_PATTERN}|time-slice)(?!\n)$", max_length=16)
]
GpuPartition = Annotated[
    str,
    Meta(
        pattern=rf"^(none|time-slice|{MIG_PROFILE_PATTERN})(?!\n)$",
        max_length=16,
        description='"none" (whole GPUs), a MIG profile such as "1g.10gb", or "time-slice".',
    ),
]

# These Literals spell the domain's vocabularies exactly (tests/unit/test_schemas.py checks).
CpuArch = Literal["amd64", "arm64"]
NetworkEgress = Literal["none", "restricted", "open"]
RuntimeClass = Literal["container", "sandboxed", "microvm", "dedicated-host"]
PreferenceKind = Literal["zone", "region", "image_cached", "gpu_model", "node_label"]
PackingPolicy = Literal["best-fit", "spread"]
CheckpointMode = Literal["none", "on-preempt", "periodic"]
# output: a chunk of a job's stdout and stderr (attrs text and job), for `pool lease logs`
TelemetryKind = Literal["queue", "startup", "execution", "utilization", "failure", "output"]

# -- base Structs ------------------------------------------------------------------------------
# msgspec does not inherit kw_only, so every subclass (schemas/v1_*.py) repeats it (fields after a
# defaulted schema_version may then be required).


class CommandBase(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Base of every command body: strict (unknown fields refused) and versioned."""

    schema_version: SchemaVersion = 1


class PartBase(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Base of nested parts: versioned with the message that carries them."""


class LenientBase(Struct, frozen=True, kw_only=True):
    """Base of replies and telemetry: readers ignore fields added by newer writers."""

    schema_version: SchemaVersion = 1

