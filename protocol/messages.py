"""The wire format of every peer-to-peer message, and its length-prefixed framing.

A message is a frozen dataclass registered under a small integer *kind* with
:func:`wire_message`. On the wire it is the msgpack array::

    [PROTOCOL_VERSION, kind, [field values in declaration order]]

with ``bytes`` as msgpack bin and ``str`` as msgpack str. A stream carries messages as
frames: a 4-byte big-endian length, then that many bytes of body (:func:`frame`,
:class:`FrameDecoder`).

Whatever arrives is hostile until proven otherwise, so :func:`decode_message` checks the
size, the envelope, the protocol version, the kind, the number of fields and the type and
length of every field against the dataclass's annotations before it builds the message;
any failure is a :class:`~atoll.protocol.errors.CodecError` that names the message type
and the field. The supported field types are ``int``, ``float``, ``str``, ``bytes``,
``bool``, ``X | None`` and ``tuple[X, ...]`` of those. An ``int`` is accepted for a
``float`` field (and becomes a float); a ``bool`` is never accepted as an ``int``. Floats
must be finite unless the field says otherwise. Per-field limits go in the field's
metadata::

    payload: bytes = field(metadata={"max_len": 1 << 20})

- ``max_len``: most characters of a ``str``, bytes of a ``bytes``, items of a tuple
  (``str`` fields default to :data:`DEFAULT_STR_MAX_LEN`, tuples to
  :data:`DEFAULT_ITEMS_MAX_LEN`; bytes are bounded by the frame size alone);
- ``item_max_len``: the same limit for the ``str``/``bytes`` items of a tuple;
- ``allow_nonfinite``: accept NaN and infinities in a ``float`` field.

Fields added to a message later take a default and come last: the encoder leaves off the
trailing fields that hold their default, and the decoder fills in the defaults of
trailing fields a sender left off, so peers that know the field and peers that do not
still understand each other (:class:`Hello`'s ``certificate``).

Before msgpack builds a single object, the decoder walks the message's headers against
the schema of its kind: only the envelope, the field list and the tuple fields may be
arrays, each no longer than the schema allows, and no map or extension type appears
anywhere. So a hostile frame builds at most what a valid message of its kind could hold;
without the walk, a 64 MiB frame of empty maps (one byte each) built some 5 GB of Python
objects before its first check.

:func:`encode_message` runs the same checks, so a peer cannot send what its peers would
refuse. Large ``bytes`` fields are copied once on decode (out of the received buffer into
the message's ``bytes``) and never again. Everything here is sans-IO: bytes in, messages
out.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgpack

from atoll.protocol.errors import CodecError, ConfigError

__all__ = [
    "DEFAULT_ITEMS_MAX_LEN",
    "DEFAULT_STR_MAX_LEN",
    "MAX_FRAME_BYTES",
    "PROTOCOL_VERSION",
    "FrameDecoder",
    "Hello",
    "decode_message",
    "encode_message",
    "encode_message_pieces",
    "frame",
    "frame_header",
    "message_kind",
    "wire_message",
]

PROTOCOL_VERSION: int = 1
"""Version of the wire format; peers with another version cannot talk to each other."""

MAX_FRAME_BYTES: int = 64 * 1024 * 1024
"""Largest frame body (and message) accepted by default: 64 MiB."""

DEFAULT_STR_MAX_LEN: int = 4096
"""Most characters of a ``str`` field whose metadata gives no ``max_len``."""

DEFAULT_ITEMS_MAX_LEN: int = 4096
"""Most items of a tuple field whose metadata gives no ``max_len``."""

T = TypeVar("T")

_HEADER = struct.Struct(">I")
_HEADER_MAX = (1 << 32) - 1
_META_KEYS = frozenset({"max_len", "item_max_len", "allow_nonfinite"})
_INT_MIN = -(1 << 63)
_UINT_END = 1 << 64  # msgpack integers span int64 and uint64


# -- field checks ---------------------------------------------------------------------------
class _Mismatch(Exception):
    """A value that does not fit its field; ``path`` locates it inside the field."""

    def __init__(self, reason: str, path: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.path = path


_Check = Callable[[object], object]
"""Checks one value and returns its normal form, or raises :class:`_Mismatch`."""


def _type_name(value: object) -> str:
    return "None" if value is None else type(value).__name__


def _check_int(value: object) -> object:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Mismatch(f"expected int, got {_type_name(value)}")
    if not _INT_MIN <= value < _UINT_END:
        raise _Mismatch(f"int {value} is outside the 64-bit range")
    return value


def _float_check(allow_nonfinite: bool) -> _Check:
    def check(value: object) -> object:
        if isinstance(value, float):
            number = value
        elif isinstance(value, int) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:
                raise _Mismatch(f"int {value} is too large for a float") from None
        else:
            raise _Mismatch(f"expected float, got {_type_name(value)}")
        if not allow_nonfinite and not math.isfinite(number):
            raise _Mismatch(f"float {number} is not finite")
        return number

    return check


def _check_bool(value: object) -> object:
    if not isinstance(value, bool):
        raise _Mismatch(f"expected bool, got {_type_name(value)}")
    return value


def _sized_check(kind: type[str] | type[bytes], max_len: int | None) -> _Check:
    unit = "characters" if kind is str else "bytes"

    def check(value: object) -> object:
        if not isinstance(value, kind):
            raise _Mismatch(f"expected {kind.__name__}, got {_type_name(value)}")
        if max_len is not None and len(value) > max_len:
            raise _Mismatch(f"{len(value)} {unit}, more than max_len {max_len}")
        return value

    return check


def _optional_check(inner: _Check) -> _Check:
    def check(value: object) -> object:
        return None if value is None else inner(value)

    return check


def _tuple_check(item: _Check, max_len: int | None) -> _Check:
    def check(value: object) -> object:
        # msgpack arrays decode as tuples here; a list is accepted from a sender's code
        if not isinstance(value, tuple | list):
            raise _Mismatch(f"expected tuple, got {_type_name(value)}")
        if max_len is not None and len(value) > max_len:
            raise _Mismatch(f"{len(value)} items, more than max_len {max_len}")
        out = []
        for i, element in enumerate(value):
            try:
                out.append(item(element))
            except _Mismatch as e:
                raise _Mismatch(e.reason, f"[{i}]{e.path}") from None
        return tuple(out)

    return check


def _limit(meta: Mapping[str, Any], key: str, where: str) -> int | None:
    value = meta.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError(f"{where}: metadata {key!r} must be an int >= 0, not {value!r}")
    return value


def _compile(annotation: object, meta: Mapping[str, Any], where: str, *, item: bool) -> _Check:
    """The check of one annotation; unsupported annotations raise ``TypeError``."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (types.UnionType, typing.Union):
        others = [a for a in args if a is not type(None)]
        if len(args) != 2 or len(others) != 1:
            raise TypeError(f"{where}: only 'X | None' unions are supported, not {annotation}")
        return _optional_check(_compile(others[0], meta, where, item=item))
    if origin is tuple:
        if item:
            raise TypeError(f"{where}: tuples of tuples are not supported")
        if len(args) != 2 or args[1] is not Ellipsis:
            raise TypeError(f"{where}: only tuple[X, ...] is supported, not {annotation}")
        max_items = _limit(meta, "max_len", where)
        if max_items is None:
            max_items = DEFAULT_ITEMS_MAX_LEN
        item_meta = {
            "max_len": meta.get("item_max_len"),
            "allow_nonfinite": meta.get("allow_nonfinite", False),
        }
        return _tuple_check(_compile(args[0], item_meta, where, item=True), max_items)
    if annotation is bool:
        return _check_bool
    if annotation is int:
        return _check_int
    if annotation is float:
        return _float_check(bool(meta.get("allow_nonfinite", False)))
    if annotation is str:
        limit = _limit(meta, "max_len", where)
        return _sized_check(str, DEFAULT_STR_MAX_LEN if limit is None else limit)
    if annotation is bytes:
        return _sized_check(bytes, _limit(meta, "max_len", where))
    raise TypeError(f"{where}: unsupported field type {annotation!r}")


@dataclass(frozen=True, slots=True)
class _Shape:
    """What a field may look like on the wire before its value is built."""

    expected: str
    """the type a check names as expected: ``int``, ``str``, ``tuple``, ..."""
    items: int
    """most items of a tuple field; -1 for a field that is no tuple"""
    item_expected: str = ""
    """the type a tuple's items are, for the same messages"""


def _bare(annotation: object) -> object:
    """``annotation`` without its ``| None``."""
    if typing.get_origin(annotation) in (types.UnionType, typing.Union):
        return next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation


def _shape(annotation: object, meta: Mapping[str, Any]) -> _Shape:
    """The wire shape of a field whose annotation :func:`_compile` has accepted."""
    bare = _bare(annotation)
    if typing.get_origin(bare) is tuple:
        limit = meta.get("max_len")
        items = DEFAULT_ITEMS_MAX_LEN if limit is None else int(limit)
        item = _bare(typing.get_args(bare)[0])
        return _Shape("tuple", items, getattr(item, "__name__", str(item)))
    return _Shape(getattr(bare, "__name__", str(bare)), -1)


# -- the registry ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Schema:
    kind: int
    cls: type
    names: tuple[str, ...]
    checks: tuple[_Check, ...]
    defaults: tuple[object, ...]
    """the defaults of the trailing fields that have one, in order"""
    shapes: tuple[_Shape, ...]
    max_array: int
    """the longest array a message of this kind holds (envelope, fields or a tuple)"""


_BY_KIND: dict[int, _Schema] = {}
_BY_CLASS: dict[type, _Schema] = {}


def wire_message(kind: int) -> Callable[[type[T]], type[T]]:
    """Register a frozen dataclass as the message of ``kind`` (an int in [0, 65535]).

    Apply it above ``@dataclass(frozen=True, slots=True)``. The field annotations are
    resolved and compiled into checks at once, so an unsupported field type, a reused
    kind, a class registered twice or a class that is not a frozen dataclass raises
    ``TypeError`` when the defining module is imported, not when the first message arrives.
    """
    if isinstance(kind, bool) or not isinstance(kind, int) or not 0 <= kind <= 0xFFFF:
        raise TypeError(f"a message kind is an int in [0, 65535], not {kind!r}")

    def register(cls: type[T]) -> type[T]:
        if not isinstance(cls, type) or not dataclasses.is_dataclass(cls):
            raise TypeError(f"@wire_message({kind}) needs a dataclass, not {cls!r}")
        name = cls.__qualname__
        params = getattr(cls, "__dataclass_params__", None)
        if params is None or not params.frozen:
            raise TypeError(f"@wire_message({kind}): {name} must be a frozen dataclass")
        if kind in _BY_KIND:
            raise TypeError(
                f"@wire_message({kind}): kind {kind} is taken by {_BY_KIND[kind].cls.__qualname__}"
            )
        if cls in _BY_CLASS:
            raise TypeError(f"{name} is already registered as kind {_BY_CLASS[cls].kind}")
        try:
            hints = typing.get_type_hints(cls)
        except Exception as e:  # a NameError, or a broken annotation string
            raise TypeError(f"{name}: cannot resolve the field annotations: {e}") from e
        names, checks, defaults, shapes = [], [], [], []
        for f in dataclasses.fields(cls):
            where = f"{name}.{f.name}"
            if not f.init:
                raise TypeError(f"{where}: every field of a message must be an init field")
            unknown = set(f.metadata) - _META_KEYS
            if unknown:
                raise TypeError(f"{where}: unknown metadata {sorted(unknown)}")
            names.append(f.name)
            checks.append(_compile(hints[f.name], f.metadata, where, item=False))
            shapes.append(_shape(hints[f.name], f.metadata))
            if f.default is not dataclasses.MISSING:
                defaults.append(f.default)
            elif f.default_factory is not dataclasses.MISSING:
                raise TypeError(f"{where}: a message field's default must be a plain value")
            elif defaults:
                raise TypeError(f"{where}: a field without a default follows one with")
        max_array = max([3, len(names), *(shape.items for shape in shapes)])
        schema = _Schema(
            kind, cls, tuple(names), tuple(checks), tuple(defaults), tuple(shapes), max_array
        )
        _BY_KIND[kind] = schema
        _BY_CLASS[cls] = schema
        return cls

    return register


def message_kind(cls: type) -> int:
    """The kind ``cls`` is registered under; an unregistered class raises CodecError."""
    schema = _BY_CLASS.get(cls)
    if schema is None:
        raise CodecError(f"{getattr(cls, '__qualname__', cls)!r} is not a registered message")
    return schema.kind


def _checked(schema: _Schema, values: Sequence[object]) -> list[object]:
    out = []
    for name, check, value in zip(schema.names, schema.checks, values, strict=True):
        try:
            out.append(check(value))
        except _Mismatch as e:
            raise CodecError(f"{schema.cls.__qualname__}.{name}{e.path}: {e.reason}") from None
    return out


# -- messages -------------------------------------------------------------------------------
def encode_message(msg: object) -> bytes:
    """The wire bytes of a registered message (checked as :func:`decode_message` would)."""
    schema = _BY_CLASS.get(type(msg))
    if schema is None:
        raise CodecError(f"{type(msg).__qualname__} is not a registered message")
    values = _checked(schema, [getattr(msg, name) for name in schema.names])
    # trailing fields at their default stay off the wire (peers without them still read it)
    optional = len(schema.names) - len(schema.defaults)
    while len(values) > optional and values[-1] == schema.defaults[len(values) - 1 - optional]:
        values.pop()
    return _pack(schema, values)


def _pack(schema: _Schema, values: list[object]) -> bytes:
    """The envelope ``[version, kind, fields]`` of checked ``values``, packed."""
    try:
        packed: bytes = msgpack.packb([PROTOCOL_VERSION, schema.kind, values], use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:  # e.g. a str with a lone surrogate
        raise CodecError(f"{schema.cls.__qualname__}: cannot encode: {e}") from e
    return packed


def encode_message_pieces(msg: object) -> tuple[bytes, bytes]:
    """:func:`encode_message` as ``(head, tail)`` whose concatenation is exactly the same
    bytes, without copying a large last field into it.

    When the message's last field is ``bytes`` of :data:`_LARGE_BODY` bytes or more (the
    payload of an all-reduce part or reduced chunk) it becomes ``tail`` as it is, and
    ``head`` ends with its msgpack ``bin 32`` header; otherwise ``tail`` is empty. Packing
    a 25 MB part into one message copied it once more (7% of an fp32 round's CPU).
    """
    schema = _BY_CLASS.get(type(msg))
    if schema is None:
        raise CodecError(f"{type(msg).__qualname__} is not a registered message")
    values = [getattr(msg, name) for name in schema.names]
    tail = values[-1] if values else None
    if not isinstance(tail, bytes) or len(tail) < _LARGE_BODY:
        return encode_message(msg), b""
    if len(tail) > 0xFFFFFFFF:  # over msgpack's bin 32, as encode_message would say
        raise CodecError(f"{schema.cls.__qualname__}: cannot encode: bytes too large")
    values = _checked(schema, values)
    # the last field is the envelope's last item: packed empty, it is its last two bytes
    values[-1] = b""
    packed = _pack(schema, values)
    return packed[: -len(_EMPTY_BIN)] + _BIN32 + _BIN32_LEN.pack(len(tail)), tail


_EMPTY_BIN = b"\xc4\x00"  # msgpack bin 8 of length 0
_BIN32 = b"\xc6"
_BIN32_LEN = struct.Struct(">I")


def decode_message(data: bytes | memoryview, *, max_bytes: int = MAX_FRAME_BYTES) -> object:
    """The message encoded in ``data``; anything malformed raises :class:`CodecError`.

    ``data`` must hold exactly one message (trailing bytes are refused). A ``memoryview``
    is read in place: the only copy of a large ``bytes`` field is the one into the
    message itself. Its headers are walked against the schema first (:func:`_walk`), so
    what msgpack then builds is bounded by the schema, not by what the bytes declare.
    """
    try:
        view = memoryview(data)
    except TypeError:
        raise CodecError(f"a message is bytes, not {type(data).__name__}") from None
    size = view.nbytes
    if size > max_bytes:
        raise CodecError(f"message of {size} bytes is over the limit of {max_bytes} bytes")
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    schema = _walk(view)
    try:
        envelope = msgpack.unpackb(
            data,
            raw=False,
            use_list=False,
            strict_map_key=True,
            max_map_len=0,
            max_ext_len=0,
            max_array_len=schema.max_array,
            max_str_len=size,
            max_bin_len=size,
        )
    except Exception as e:  # hostile bytes may raise anything msgpack has; none escapes
        raise CodecError(f"message is not valid msgpack: {type(e).__name__}: {e}") from None
    values = envelope[2]
    name = schema.cls.__qualname__
    optional = len(schema.names) - len(schema.defaults)
    values = (*values, *schema.defaults[len(values) - optional :])
    checked = _checked(schema, values)
    try:
        return schema.cls(*checked)
    except (ValueError, TypeError) as e:  # the message's own __post_init__ refused it
        raise CodecError(f"{name}: {e}") from e


# -- the walk before the build ------------------------------------------------------------
def _walk(view: memoryview) -> _Schema:
    """Check the msgpack headers of a message against its kind's schema, building nothing
    but the version and the kind; return the schema.

    Every array is counted before its items are looked at, and every other value is only
    skipped by its length, so a frame declaring millions of items costs a few header
    reads. What passes holds arrays only where the schema has them (the envelope, the
    field list, tuple fields of scalars) and no maps or extension types, so msgpack builds
    no more than the schema allows.
    """
    end = len(view)
    kind_name, count, pos = _head(view, 0)
    if kind_name != "tuple" or count != 3:
        raise CodecError("message is not a [version, kind, fields] array")
    version, pos = _int_value(view, pos, "version")
    if version != PROTOCOL_VERSION:
        raise CodecError(
            f"message has protocol version {version}, this peer speaks version {PROTOCOL_VERSION}"
        )
    kind, pos = _int_value(view, pos, "kind")
    schema = _BY_KIND.get(kind)
    if schema is None:
        raise CodecError(f"unknown message kind {kind}")
    name = schema.cls.__qualname__
    got, count, pos = _head(view, pos)
    if got != "tuple":
        if got not in _CONTAINERS:
            _skip(pos, count, end)  # a message cut short says so first
        raise CodecError(f"{name}: fields are {got}, not an array")
    total, optional = len(schema.names), len(schema.names) - len(schema.defaults)
    if not optional <= count <= total:
        expected = f"{optional} to {total}" if schema.defaults else f"{total}"
        raise CodecError(f"{name}: {count} fields, expected {expected}")
    for field_name, shape in zip(schema.names, schema.shapes[:count], strict=False):
        got, length, pos = _head(view, pos)
        where = f"{name}.{field_name}"
        if got == "tuple" and shape.items >= 0:
            if length > shape.items:
                raise CodecError(f"{where}: {length} items, more than max_len {shape.items}")
            for i in range(length):
                got, length, pos = _head(view, pos)
                if got in _CONTAINERS:
                    raise CodecError(f"{where}[{i}]: expected {shape.item_expected}, got {got}")
                pos = _skip(pos, length, end)
        elif got in _CONTAINERS:
            raise CodecError(f"{where}: expected {shape.expected}, got {got}")
        else:
            pos = _skip(pos, length, end)
    if pos != end:
        raise CodecError(f"message is not valid msgpack: ExtraData: {end - pos} bytes after it")
    return schema


_CONTAINERS = frozenset({"tuple", "dict", "ExtType"})
"""what a msgpack array, map and extension value decode to here"""

_TRUNCATED = "message is not valid msgpack: it ends inside a value"

# msgpack's one-byte headers that carry no length: (type name, bytes of payload)
_FIXED: dict[int, tuple[str, int]] = {
    0xC0: ("None", 0),
    0xC2: ("bool", 0),
    0xC3: ("bool", 0),
    0xCA: ("float", 4),
    0xCB: ("float", 8),
    **{b: ("int", 1 << (b - 0xCC)) for b in range(0xCC, 0xD0)},  # uint 8..64
    **{b: ("int", 1 << (b - 0xD0)) for b in range(0xD0, 0xD4)},  # int 8..64
    **{b: ("ExtType", 1 + (1 << (b - 0xD4))) for b in range(0xD4, 0xD9)},  # fixext
}
# headers followed by a big-endian length: (type name, bytes of that length)
_SIZED: dict[int, tuple[str, int]] = {
    0xC4: ("bytes", 1),
    0xC5: ("bytes", 2),
    0xC6: ("bytes", 4),
    0xC7: ("ExtType", 1),
    0xC8: ("ExtType", 2),
    0xC9: ("ExtType", 4),
    0xD9: ("str", 1),
    0xDA: ("str", 2),
    0xDB: ("str", 4),
    0xDC: ("tuple", 2),
    0xDD: ("tuple", 4),
    0xDE: ("dict", 2),
    0xDF: ("dict", 4),
}


def _head(view: memoryview, pos: int) -> tuple[str, int, int]:
    """The header of the value at ``pos``: its type name, its item count (an array or a
    map) or its payload's length in bytes (anything else), and where the header ends."""
    if pos >= len(view):
        raise CodecError(_TRUNCATED)
    byte = view[pos]
    pos += 1
    if byte <= 0x7F or byte >= 0xE0:
        return "int", 0, pos
    if byte <= 0x8F:
        return "dict", byte & 0x0F, pos
    if byte <= 0x9F:
        return "tuple", byte & 0x0F, pos
    if byte <= 0xBF:
        return "str", byte & 0x1F, pos
    fixed = _FIXED.get(byte)
    if fixed is not None:
        return fixed[0], fixed[1], pos
    sized = _SIZED.get(byte)
    if sized is None:  # 0xc1, which msgpack never uses
        raise CodecError(f"message is not valid msgpack: byte 0x{byte:02x} at {pos - 1}")
    type_name, width = sized
    if pos + width > len(view):
        raise CodecError(_TRUNCATED)
    length = int.from_bytes(view[pos : pos + width], "big")
    if type_name == "ExtType":
        length += 1  # the extension's type byte
    return type_name, length, pos + width


def _skip(pos: int, length: int, end: int) -> int:
    """Where a scalar whose payload of ``length`` bytes starts at ``pos`` ends."""
    if pos + length > end:
        raise CodecError(_TRUNCATED)
    return pos + length


def _int_value(view: memoryview, pos: int, what: str) -> tuple[int, int]:
    """The integer at ``pos`` (the envelope's version or kind) and where it ends."""
    got, length, after = _head(view, pos)
    if got not in _CONTAINERS:
        after = _skip(after, length, len(view))  # a message cut short says so first
    if got != "int":
        raise CodecError(f"message {what} is {got}, not int")
    value = msgpack.unpackb(view[pos:after])
    assert isinstance(value, int)  # an int header decodes to an int
    return value, after


# -- framing --------------------------------------------------------------------------------
def _check_max_bytes(max_bytes: int) -> int:
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int):
        raise ConfigError(f"max_bytes must be an int, not {max_bytes!r}")
    if not 0 <= max_bytes <= _HEADER_MAX:
        raise ConfigError(f"max_bytes must be in [0, {_HEADER_MAX}], not {max_bytes}")
    return max_bytes


def frame(body: bytes, *, max_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """``body`` prefixed with its length as 4 big-endian bytes."""
    return frame_header(body, max_bytes=max_bytes) + body


def frame_header(body: bytes | int, *, max_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """The 4-byte length header of ``body``'s frame, or of a body of ``body`` bytes (write
    it, then the body: a large body need not be copied behind its header). CodecError when
    the body is over the limit."""
    size = body if isinstance(body, int) else len(body)
    if size > _check_max_bytes(max_bytes):
        raise CodecError(f"frame body of {size} bytes is over the limit of {max_bytes} bytes")
    return _HEADER.pack(size)


class FrameDecoder:
    """Cuts a byte stream into frame bodies, sans-IO.

    Feed it whatever the transport delivered, in pieces of any size; :meth:`feed` returns
    the bodies completed so far, in order, and keeps a partial frame for the next call. A
    length header over ``max_bytes`` raises :class:`CodecError` as soon as the header is
    complete, before any of that body is waited for; the decoder is then failed for good
    (every later :meth:`feed` raises too), since the stream is out of step and must be
    closed.
    """

    __slots__ = ("_body", "_buf", "_failed", "_got", "_max", "_need")

    def __init__(self, max_bytes: int = MAX_FRAME_BYTES) -> None:
        self._max = _check_max_bytes(max_bytes)
        self._buf = bytearray()  # bytes of headers and small frames not yet complete
        # a large body in the making: its pieces (joined once, when complete), their total
        # length and the length it needs; each received byte is then copied once
        self._body: list[bytes | memoryview] = []
        self._got = 0
        self._need = -1
        self._failed: str | None = None

    @property
    def max_bytes(self) -> int:
        """The largest body this decoder accepts."""
        return self._max

    @property
    def buffered(self) -> int:
        """Bytes held for a frame not yet complete (its header included)."""
        return len(self._buf) + (self._got + _HEADER.size if self._need >= 0 else 0)

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytes]:
        """Add received bytes; return the frame bodies they complete."""
        if self._failed is not None:
            raise CodecError(f"frame stream failed earlier ({self._failed}); close it")
        out: list[bytes] = []
        view = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
        pos, end = 0, len(view)
        while pos < end:
            if self._need >= 0:  # inside a large body: take what it still needs
                take = min(self._need - self._got, end - pos)
                piece = view[pos : pos + take]
                # bytes cannot change under us; anything else is copied now
                self._body.append(piece if isinstance(data, bytes) else piece.tobytes())
                self._got += take
                pos += take
                if self._got == self._need:
                    out.append(b"".join(self._body))  # the one copy
                    self._body.clear()
                    self._got, self._need = 0, -1
                continue
            # a header (maybe split across feeds), then a small body in the buffer
            buf = self._buf
            if len(buf) < _HEADER.size:
                take = min(_HEADER.size - len(buf), end - pos)
                buf += view[pos : pos + take]
                pos += take
                if len(buf) < _HEADER.size:
                    break
            (size,) = _HEADER.unpack_from(buf, 0)
            if size > self._max:
                self._failed = f"a frame of {size} bytes, over the limit of {self._max}"
                buf.clear()
                raise CodecError(f"frame stream: {self._failed}")
            have = len(buf) - _HEADER.size
            if have == 0 and size >= _LARGE_BODY:  # a large body: collect it in pieces
                buf.clear()
                self._need, self._got = size, 0
                if size == 0:
                    out.append(b"")
                    self._need = -1
                continue
            take = min(size - have, end - pos)
            buf += view[pos : pos + take]
            pos += take
            if len(buf) - _HEADER.size == size:
                out.append(bytes(buf[_HEADER.size :]))
                buf.clear()
        return out


_LARGE_BODY = 1 << 16
"""Bodies from this size on are collected as pieces and joined once, not appended to a
buffer and copied out of it (two copies of every byte; 7% of an fp32 round's CPU)."""


# -- the first message ----------------------------------------------------------------------
@wire_message(1)
@dataclass(frozen=True, slots=True)
class Hello:
    """The first message on a new stream between two peers.

    It says who is speaking and for which run. A peer closes the stream when the other
    side's ``run_id`` is not its own run's (:meth:`atoll.protocol.manifest.RunManifest.run_id`):
    peers of different runs never mix. In a private run it also closes the stream when the
    other side is not a member (``certificate``, checked by the node's membership policy).
    """

    protocol: int
    """the sender's :data:`PROTOCOL_VERSION` (the envelope carries it too; kept for logs)"""
    run_id: str = field(metadata={"max_len": 64})
    """the sender's run id, 64 lowercase hex digits"""
    peer_id: str = field(metadata={"max_len": 128})
    """the sender's libp2p peer id (base58)"""
    agent: str = field(metadata={"max_len": 64})
    """the sender's software and version, e.g. ``atoll/0.1.0``"""
    certificate: bytes | None = field(default=None, metadata={"max_len": 320})
    """the sender's member certificate in a private run (None: it shows none); left off
    the wire when None, so a Hello without one reads as before the field existed"""
