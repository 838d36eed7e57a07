#!/usr/bin/env bash
# Debian packages that the channel tests of `make test` use, installed by .ci/run before `make test`:
#   chromium       headless screenshots and slide-height measurements (tests/test_slides.py, notebook channel)
#   poppler-utils  pdftotext / pdftoppm for the one-chapter PDF test (tests/test_pdf.py)
#   TeX Live       XeLaTeX and latexmk for that PDF (tools/install_tex.sh)
#   tools/js       KaTeX and jupyterlab-myst's MyST parser (npm ci; Node.js from Debian where missing), with which
#                  tests/test_channels_notebooks.py renders the Colab copies and student notebooks
# Every test that needs one of these skips with a reason where it is missing, so `make test` also runs on a
# machine without them; CI installs them so that those tests run there. Run as root (or with sudo).
set -euo pipefail
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
need=()
command -v chromium >/dev/null || need+=(chromium)
command -v pdftotext >/dev/null || need+=(poppler-utils)
command -v npm >/dev/null || need+=(nodejs npm)
if [ ${#need[@]} -gt 0 ]; then
    $SUDO apt-get update -q
    $SUDO apt-get install -y -q --no-install-recommends "${need[@]}" fonts-dejavu-core
fi
bash "$(dirname "$0")/install_tex.sh"
if [ ! -d "$(dirname "$0")/js/node_modules/katex" ]; then
    (cd "$(dirname "$0")/js" && npm ci --no-audit --no-fund)
fi
