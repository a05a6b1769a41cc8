"""Decompressing ``.gz`` and ``.zst`` inputs as a stream whose errors name the file: data
that ends early or does not decompress is a DamagedInputError (``sources.iter_chunks``
adds the line), never a quiet end of the corpus.
"""

from __future__ import annotations

import gzip
import io
import zlib
from typing import BinaryIO

from megatron_jreg.errors import InputError


class DamagedInputError(InputError):
    """Compressed data that ends early or does not decompress; ``iter_chunks`` adds the line."""

    def __init__(self, path: str, detail: str) -> None:
        super().__init__(f"{path}: {detail}; the file is damaged: re-create or re-download it")
        self.path, self.detail = path, detail


class _TruncatedError(Exception):
    """Compressed data that stops inside a frame or member."""


class _InnerReader(io.RawIOBase):
    """A readable raw stream over ``self._inner``, which it closes."""

    _inner: BinaryIO

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        if not self.closed:
            self._inner.close()
        super().close()


class _ZstdReader(_InnerReader):
    """zstd frames, one after another, failing at the end if the last one is incomplete.

    zstandard's ``stream_reader`` ends quietly where a truncated file ends, which would
    silently drop the rest of the corpus.
    """

    _READ = 1 << 16  # compressed bytes per step: bounds the output of one decompress call

    def __init__(self, path: str) -> None:
        import zstandard

        self._zstd = zstandard
        self._inner = open(path, "rb")
        self._frame = zstandard.ZstdDecompressor().decompressobj()
        self._in_frame = False  # bytes of the current frame were read, its end was not
        self._out = b""
        self._pos = 0

    def readinto(self, buffer) -> int:
        while self._pos == len(self._out):
            data = self._inner.read(self._READ)
            if not data:
                if self._in_frame:
                    raise _TruncatedError("the file ends inside a zstd frame")
                return 0
            parts = []
            while data:
                parts.append(self._frame.decompress(data))
                self._in_frame, data = True, b""
                if self._frame.eof:  # the frame ended: what follows starts the next one
                    data = self._frame.unused_data
                    self._frame = self._zstd.ZstdDecompressor().decompressobj()
                    self._in_frame = False
            self._out, self._pos = b"".join(parts), 0
        n = min(len(buffer), len(self._out) - self._pos)
        buffer[:n] = memoryview(self._out)[self._pos:self._pos + n]
        self._pos += n
        return n


class CheckedReader(_InnerReader):
    """A decompressing stream whose errors name the file (gzip's EOFError names nothing)."""

    def __init__(self, path: str, compression: str) -> None:
        self._path = path
        self._name = {"gz": "gzip", "zst": "zstd"}[compression]
        # One step per call (gzip's readinto1): the data before a damaged spot comes out
        # first, so the error can name the line where the damage is.
        if compression == "gz":
            self._inner = gzip.open(path, "rb")
            self._read = self._inner.readinto1
            self._errors = (EOFError, gzip.BadGzipFile, zlib.error)
        else:
            self._inner = _ZstdReader(path)
            self._read = self._inner.readinto
            self._errors = (_TruncatedError, self._inner._zstd.ZstdError)

    def readinto(self, buffer) -> int:
        try:
            return self._read(buffer)
        except self._errors as e:
            how = "truncated" if isinstance(e, (EOFError, _TruncatedError)) else "corrupt"
            raise DamagedInputError(self._path, f"{self._name} data is {how} ({e})") from None
