"""Wire format, version 2: the family-independent codec of pdc's control-plane messages.

Every message is a 24-byte header followed by a body. All integers are little-endian; there
is no padding anywhere. docs/wire-format.md is the byte-level reference.

    offset  size  field
    0       4     magic b"PDCW"
    4       2     wire version (WIRE_VERSION)
    6       1     message type (MessageType)
    7       1     flags: none are defined in version 2, so the byte must be 0
    8       8     spec fingerprint: the first 8 bytes of the spec's sha256, as a u64
    16      4     body length in bytes
    20      4     CRC-32 (zlib) of header bytes 0..19 followed by the body
    24      ...   body

Decoder invariants (bench/fuzz_wire.py checks them on millions of mutated inputs):
- `decode` raises WireError and nothing else, and every WireError names the field;
- no length read from the wire is trusted: each is checked against the bytes left AND a
  declared maximum before anything is allocated, so a decoder never over-reads, never
  allocates more than the input justifies and never loops longer than the input is long;
- the encoding is canonical: `decode(buf)` succeeds only when `encode(decode(buf)) == buf`.
  No byte is padding or "don't care", so a message means exactly one thing.

Note [Why a checksum]: DESIGN.md §5 asks for magic, version, type and fingerprint; the
CRC-32 is our addition. Without it a flipped bit in a room id or a page id decodes to
another *valid* message, and the decode side would free or fill the wrong request's pages:
exactly the silent cross-request corruption that PD deployments keep hitting. ZeroMQ over TCP protects the hop, not a sender that overruns a buffer or a
relay that rewrites frames. CRC-32 catches every burst of up to 32 bits and all but 2^-32
of random damage, and costs ~1 µs per KiB in zlib's C code.

The messages and limits live in runtime/wire_messages.py, the codec in runtime/wire_codec.py;
this module is their one public face. The runtime's `Family` (runtime/family.py) binds a
family: its fingerprint and its wire components (names in spec order, tensor names, allowed
layer ids), and wraps encode/decode.
Messages are frozen dataclasses that validate themselves on construction, so an encoder
can only be handed, and a decoder can only return, a message that is valid on its own.
"""

from .plan_types import RankId
from .wire_codec import (
    ENTRY_BYTES,
    FieldSpan,
    Reader,
    Writer,
    decode,
    encode,
    field_map,
)
from .wire_messages import (
    HEADER_BYTES,
    MAX_AGENT_INFO_BYTES,
    MAX_BODY_BYTES,
    MAX_EVENT_BYTES,
    MAX_INSTANCE_BYTES,
    MAX_PAGE_IDS,
    MAX_REASON_BYTES,
    MAX_SECTION_ENTRIES,
    NO_INDEX,
    PLAN_DIGEST_BYTES,
    WIRE_MAGIC,
    WIRE_VERSION,
    Abort,
    AbortAck,
    Heartbeat,
    KVPoll,
    Message,
    MessageType,
    PeerSide,
    RegEntry,
    Register,
    Section,
    Status,
    TransferRequest,
    WireError,
)
from .wire_ring import MAX_RING_BLOCKS, RingFilled, RingFreed
from .wire_sections import WireComponent, registration_sections

__all__ = [
    "ENTRY_BYTES",
    "HEADER_BYTES",
    "MAX_AGENT_INFO_BYTES",
    "MAX_BODY_BYTES",
    "MAX_INSTANCE_BYTES",
    "MAX_PAGE_IDS",
    "MAX_EVENT_BYTES",
    "MAX_REASON_BYTES",
    "MAX_RING_BLOCKS",
    "MAX_SECTION_ENTRIES",
    "NO_INDEX",
    "PLAN_DIGEST_BYTES",
    "WIRE_MAGIC",
    "WIRE_VERSION",
    "Abort",
    "AbortAck",
    "FieldSpan",
    "Heartbeat",
    "KVPoll",
    "Message",
    "MessageType",
    "PeerSide",
    "RankId",
    "Reader",
    "RingFilled",
    "RingFreed",
    "RegEntry",
    "Register",
    "Section",
    "Status",
    "TransferRequest",
    "WireComponent",
    "WireError",
    "Writer",
    "decode",
    "encode",
    "field_map",
    "registration_sections",
]
