"""The course as a static website (`make site`): Jupyter Book 2 parses the student release, labkit renders it.

build (the steps), pages (generated MyST pages, links to repository files), mdast (MyST's AST of one page
as HTML), render (every page, the navigation, the files they use), leaks (what the site must never show).
Data: site/site.yml, site/labs.yml, site/glossary.yml; the stylesheet: site/site.css.
"""
