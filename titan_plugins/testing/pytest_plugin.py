"""The conformance kit's pytest plugin (entry point ``pytest11``).

It must stay cheap: pytest loads it in every session of every project that has
titan-plugins installed, so nothing heavy is imported at module level.
"""
