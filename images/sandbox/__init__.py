"""The default sandbox image: Debian bookworm (minbase) plus the packages in packages.txt."""
