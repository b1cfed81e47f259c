"""tiercache: a tiered KV-cache storage engine for LLM serving.

Importing the package is cheap on purpose: it never imports torch, vLLM, boto3 or LMDB.
Heavy modules are imported by the tier that needs them.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
