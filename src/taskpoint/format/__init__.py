"""The format layer: how a checkpoint's bytes are laid out in storage.

Owns: the codecs (gzip, zstd, none), parallel gzip with labelled members, the tar archive of a folder with
extraction that cannot escape it, and the JSON records beside each object (a checkpoint's record, a
manager step's manifest), with their format versions.

May import: the standard library, the codec and hash libraries (isal, zstandard, blake3),
:mod:`taskpoint.errors`, and the stream helpers and local-write constants of :mod:`taskpoint.storage`. Nothing
here does storage I/O.
"""
