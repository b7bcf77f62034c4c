"""KV encrypted at rest in the shared tiers: AES-256-GCM, a data key per namespace.

KV can be inverted back to the prompt that made it, and a shared tier holds many
tenants' KV side by side (issue 47). With ``encryption.enabled`` every object a lower
tier writes is sealed here and every object it reads is opened here:

* **Keys.** A master key (32 bytes, hex, from ``encryption.key_file`` or
  ``KVTIER_ENCRYPTION_KEY``; kept outside the tier) derives one data key per namespace
  digest by HKDF-SHA256. The namespace digest mixes in the request's ``cache_salt``
  (a tenant's, with ``kvtier router --tenants``), model, adapter and geometry, so each
  tenant's KV is under keys of its own. Several master keys may be listed (one a
  line): the first seals, any opens (a rotation; each object names its key by an 8-byte
  id, never the key).
* **Objects.** The payload is encrypted with a fresh random 96-bit nonce per write (the
  NIST bound for random nonces, 2**32 messages per key, is far beyond one namespace's
  chunk writes); the nonce, the 16-byte tag and the key id go in the header, whose
  fields (namespace, key, parent, tokens, dtype, shape, length) are the associated data.
  The header checksum covers the ciphertext. So the tag is the integrity check: a byte
  changed, an object moved to another key or namespace, or one planted by a writer
  without the key fails it and is a counted corruption and a miss.
* **What is refused without deleting it**: a plaintext object where encryption is on,
  and a sealed one under a key this node does not hold (another configuration sharing
  the tier): a miss each, counted, the object left for whoever can read it.
* **The host pool holds plaintext** (``/dev/shm`` or pinned memory of the engine's own
  process tree): sealing is for the tiers other machines and people can reach. Sealing
  and opening run on the tiers' IO threads, about 8 GB/s a core with AES-NI here.

Threads: ``ChunkCipher`` may be used from any thread (its key cache has a lock).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import msgpack

from kvtier.objformat import KID_BYTES, NONCE_BYTES, ChunkMeta, CorruptObject, Seal
from kvtier.secretfile import secret_lines

ENV = "KVTIER_ENCRYPTION_KEY"
MAX_DATA_KEYS = 4096


class KeyError_(ValueError):
    """The master key cannot be used; the message says where it came from and why."""


class ForeignKey(CorruptObject):
    """Sealed under a key this node does not hold, or not sealed where it must be: a
    miss, but not damage (the object is left where it is)."""


def load_master_keys(path: Path | None, environ: dict[str, str] | None = None) -> list[bytes]:
    """The master keys (64 hex characters each) from ``path`` (one a line, ``#``
    comments skipped), else ``KVTIER_ENCRYPTION_KEY`` (``;``-separated); [] if neither."""
    found, where = secret_lines(path, ENV, "encryption key", KeyError_, environ)
    keys = []
    for i, text in enumerate(found):
        try:
            key = bytes.fromhex(text)
        except ValueError:
            key = b""
        if len(key) != 32:
            raise KeyError_(f"encryption key {i + 1} in {where} is not 64 hex characters "
                            "(32 bytes); make one with `openssl rand -hex 32`")
        keys.append(key)
    return keys


def _aad(meta: ChunkMeta) -> bytes:
    """The header fields a seal authenticates (everything but the checksum and seal)."""
    return bytes(msgpack.packb(
        [meta.namespace, bytes(meta.key), b"" if meta.parent is None else bytes(meta.parent),
         meta.num_tokens, meta.dtype, list(meta.shape), meta.payload_len],
        use_bin_type=True))


class ChunkCipher:
    """Seals and opens chunk payloads (see the module docstring)."""

    def __init__(self, master_keys: Sequence[bytes]) -> None:
        if not master_keys:
            raise KeyError_(f"encryption needs a master key: set encryption.key_file or {ENV}")
        self._masters = {self._kid(k): k for k in master_keys}
        self.kid = self._kid(master_keys[0])
        self._lock = threading.Lock()
        self._data_keys: OrderedDict[tuple[bytes, bytes], bytes] = OrderedDict()

    @staticmethod
    def _kid(master: bytes) -> bytes:
        return hmac.new(master, b"kvtier key id", hashlib.sha256).digest()[:KID_BYTES]

    def _data_key(self, kid: bytes, namespace: bytes) -> bytes:
        with self._lock:
            got = self._data_keys.get((kid, namespace))
            if got is not None:
                self._data_keys.move_to_end((kid, namespace))
                return got
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF

        key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                   info=b"kvtier chunk key v1\0" + namespace).derive(self._masters[kid])
        with self._lock:
            self._data_keys[(kid, namespace)] = key
            while len(self._data_keys) > MAX_DATA_KEYS:
                self._data_keys.popitem(last=False)
        return key

    def seal(self, meta: ChunkMeta, payload: memoryview,
             out: memoryview | None = None) -> tuple[memoryview, Seal]:
        """The ciphertext of ``payload`` (same length; written into ``out`` if given, a
        buffer of at least that size not overlapping ``payload``) and its seal."""
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        nonce = os.urandom(NONCE_BYTES)
        enc = Cipher(algorithms.AES(self._data_key(self.kid, meta.namespace)),
                     modes.GCM(nonce)).encryptor()
        enc.authenticate_additional_data(_aad(meta))
        n = memoryview(payload).nbytes
        dst = memoryview(bytearray(n)) if out is None else out[:n]
        enc.update_into(payload, dst)
        enc.finalize()
        return dst, Seal(self.kid, nonce, enc.tag)

    def open_into(self, meta: ChunkMeta, seal: Seal | None, src: memoryview,
                  dst: memoryview) -> None:
        """Decrypt ``src`` into ``dst`` (same length, not overlapping); ``ForeignKey`` if
        it is not sealed or sealed under a key this node lacks, ``CorruptObject`` if
        the tag fails (``dst`` then holds garbage: the caller must not serve it)."""
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        if seal is None:
            raise ForeignKey("a plaintext object where encryption is on")
        if seal.kid not in self._masters:
            raise ForeignKey(f"sealed under key {seal.kid.hex()}, which this node lacks")
        dec = Cipher(algorithms.AES(self._data_key(seal.kid, meta.namespace)),
                     modes.GCM(seal.nonce, seal.tag)).decryptor()
        dec.authenticate_additional_data(_aad(meta))
        dec.update_into(src, dst)
        try:
            dec.finalize()
        except InvalidTag:
            raise CorruptObject("the payload's authentication tag does not verify "
                                "(changed, moved, or written without the key)") from None
