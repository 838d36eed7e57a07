// Render exported notebook Markdown as KaTeX and jupyterlab-myst do (tests/test_channels_notebooks.py).
// stdin: {"cells": [markdown, ...], "formulas": [[[display, tex], ...] per cell], "frontmatter": {"\\E": "..."}}
// stdout: JSON of failures and counts.
//  * katex_plain: every formula (as a CommonMark+KaTeX renderer such as Colab finds it) rendered with no macros,
//    and again after the first cell's formulas in one shared macro table (globalGroup: definitions persist);
//  * myst: each cell parsed by jupyterlab-myst's parser (myst-parser 1.7.3), its maths rendered by myst-transforms'
//    math transform (KaTeX with the front matter's `math` macros, a fresh copy per formula, as jupyterlab-myst does);
//    a formula holding a block-quote marker `>` counted (it renders as a stray `>`), the tree's text nodes searched for raw TeX and MyST syntax, HTML nodes for boxes.
import katex from 'katex';
import { mystParse } from 'myst-parser';
import { mathTransform } from 'myst-transforms';
import { VFile } from 'vfile';
import { selectAll } from 'unist-util-select';

const input = JSON.parse(await new Promise((resolve) => {
  let s = ''; process.stdin.on('data', (d) => { s += d; }); process.stdin.on('end', () => resolve(s));
}));
const out = { formulas: 0, katex_plain: [], katex_shared: [], myst_math: 0, myst_errors: [], raw_tex: [],
              html_boxes: [], myst_syntax: [], quote_markers: [], quoted_math: 0, blockquotes: 0, text: [] };

function render(tex, display, macros, globalGroup) {
  try { katex.renderToString(tex, { displayMode: display, throwOnError: true, macros, globalGroup,
                                    strict: 'ignore' }); return null; }
  catch (e) { return String(e.message || e); }
}
const shared = {};
(input.formulas || []).forEach((cell, k) => {
  cell.forEach(([display, tex]) => {
    out.formulas += 1;
    const err = render(tex, display, {}, false);
    if (err && k > 0) out.katex_plain.push({ cell: k, tex: tex.slice(0, 120), err: err.slice(0, 200) });
    const err2 = render(tex, display, shared, true);
    if (err2) out.katex_shared.push({ cell: k, tex: tex.slice(0, 120), err: err2.slice(0, 200) });
  });
});

const macros = Object.fromEntries(Object.entries(input.frontmatter || {}).map(([k, v]) => [k, { macro: v }]));
const RAW_TEX = /\\[A-Za-z]{2,}|\$\$|(^|\s)\$[^$\s][^$]*\$|\\\(|\\\[/;
const MYST = /\{[a-z][\w:-]*\}`|^\s*(```|:::)\{|^\([\w:-]+\)=/m;
input.cells.forEach((md, k) => {
  const tree = mystParse(md);
  const file = new VFile();
  mathTransform(tree, file, { macros });
  for (const node of selectAll('math, inlineMath', tree)) {
    out.myst_math += 1;
    if (/(^|\n)\s*>/.test(String(node.value))) out.quote_markers.push({ cell: k, tex: String(node.value).slice(0, 120) });
    if (node.error) out.myst_errors.push({ cell: k, tex: String(node.value).slice(0, 120), err: String(node.message).slice(0, 200) });
  }
  for (const bq of selectAll('blockquote', tree)) {
    out.blockquotes += 1;
    out.quoted_math += selectAll('math', bq).length;
  }
  const texts = [];
  for (const node of selectAll('text', tree)) {
    texts.push(node.value);
    if (RAW_TEX.test(node.value)) out.raw_tex.push({ cell: k, text: node.value.slice(0, 160) });
    if (MYST.test(node.value)) out.myst_syntax.push({ cell: k, text: node.value.slice(0, 160) });
  }
  for (const node of selectAll('html', tree)) {
    if (/<div\b/.test(node.value)) out.html_boxes.push({ cell: k, html: node.value.slice(0, 120) });
  }
  for (const node of selectAll('mystDirective, mystRole', tree)) {
    out.myst_syntax.push({ cell: k, text: `${node.type} ${node.name}` });
  }
  out.text.push(texts.join(' '));
});
process.stdout.write(JSON.stringify(out));
