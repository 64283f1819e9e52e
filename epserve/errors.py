"""Exceptions epserve raises. Every rank raises the same class with the same message when a
collective check fails, so no rank is left waiting on another."""


class EPServeError(RuntimeError):
    """Base class of epserve's errors."""


class ConfigError(EPServeError, ValueError):
    """A configuration or an input that epserve cannot serve."""


class RankMismatchError(ConfigError):
    """Ranks disagree on something they must share (a config field, a shape)."""


class RankFailedError(EPServeError):
    """Another rank (or this one) failed a stage; raised on every rank."""


class PeerTimeoutError(EPServeError):
    """A bounded device-side wait for a peer ran out: the peer is dead, stuck or slow."""


class BuildError(EPServeError):
    """NVRTC refused a kernel; the message carries the compiler log."""
