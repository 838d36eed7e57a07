#!/usr/bin/env bash
# Install what `make pdf` needs, from Debian's (or Ubuntu's) packages: XeLaTeX, latexmk, the LaTeX packages Sphinx's
# LaTeX writer loads, and the FreeFont family the handout is set in. About 130 MB to download; run as root
# (or with sudo). Not part of `make test`.
set -euo pipefail
if command -v xelatex >/dev/null && command -v latexmk >/dev/null && fc-list | grep -q FreeSerif; then
    echo "XeLaTeX, latexmk and FreeFont are already installed"; exit 0
fi
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends \
    texlive-xetex texlive-latex-recommended texlive-latex-extra texlive-fonts-recommended \
    tex-gyre lmodern latexmk fonts-freefont-otf
xelatex --version | head -1
