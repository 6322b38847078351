"""The one exception type for mistakes a user can make; the CLI and recipes print it as one line."""


class UserError(Exception):
    """Bad input (config, data, paths, launch setup): the message says what and where."""
