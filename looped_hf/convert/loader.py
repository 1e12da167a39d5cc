"""The checkpoint reader, under the name the converters have always imported it by: it lives in
``looped_hf/checkpoint_reader.py``, below every command that reads a foreign folder (convert,
retrofit, train's teacher), so that reading one imports no command package.
"""

from ..checkpoint_reader import *  # noqa: F403
from ..checkpoint_reader import __all__ as __all__
