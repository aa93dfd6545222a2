"""What every room stands on: the content-keyed model cache and progress bars on stderr."""
