"""The default sandbox image: Debian bookworm plus the packages in packages.txt, built two ways
from that one list: locally by debootstrap (:mod:`images.local`, no registry) and for a
registry from the Dockerfile here (:mod:`images.build`)."""
