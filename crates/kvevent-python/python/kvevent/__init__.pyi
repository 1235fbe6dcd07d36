from ._kvevent import (
    DecodeError as DecodeError,
    Record as Record,
    Recording as Recording,
    RecordingError as RecordingError,
    __version__ as __version__,
    decode as decode,
    fingerprint_keys as fingerprint_keys,
)
