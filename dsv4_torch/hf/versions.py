"""The transformers versions whose DeepSeek-V4 internals this package was checked against."""

from importlib import metadata

# [min, max): 5.23.x. The capture and the integration hook into internals (attention function lookup,
# compressor/indexer modules, cache classes), so any other version fails loudly instead of silently.
SUPPORTED_TRANSFORMERS = ("5.23.0", "5.24.0")


def require_supported_transformers() -> str:
    """Return the installed transformers version; raise ImportError outside SUPPORTED_TRANSFORMERS."""
    from packaging.version import Version

    try:
        found = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        raise ImportError("transformers is not installed; dsv4_torch.hf needs transformers>=5.23.0,<5.24") from None
    lo, hi = SUPPORTED_TRANSFORMERS
    if not Version(lo) <= Version(found) < Version(hi):
        raise ImportError(
            f"transformers {found} is not supported by dsv4_torch.hf: need >={lo},<{hi} "
            "(DeepSeek-V4 internals are version specific)"
        )
    return found
