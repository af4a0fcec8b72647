"""MkDocs hook (mkdocs.yml ``hooks:``): the API pages and the committed results in the site.

- A nav entry ``- hf_relpos.X: api/X.md`` (``api/hf_relpos.md`` for the package itself) whose file does not exist
  in ``docs/api/`` becomes a generated page ``# hf_relpos.X`` followed by mkdocstrings' ``::: hf_relpos.X``, so
  adding a module to the reference is one nav line; a page that needs prose around the reference is a file.
- The repository's ``results/`` folder (benchmark tables, the comparison, figures, each with its command) is
  published as ``results/...`` beside the guides, so that the guides link to the measured files themselves
  instead of copies (``not_in_nav`` keeps them out of the navigation).
"""

from pathlib import Path

from mkdocs.structure.files import File


def _nav_paths(items):
    for item in items:
        if isinstance(item, dict):
            for value in item.values():
                yield from _nav_paths(value if isinstance(value, list) else [value])
        elif isinstance(item, str):
            yield item


def on_files(files, config):
    for path in _nav_paths(config["nav"] or []):
        if not path.startswith("api/") or files.get_file_from_path(path) is not None:
            continue
        stem = path[len("api/"):-len(".md")]
        module = stem if stem == "hf_relpos" else f"hf_relpos.{stem}"
        files.append(File.generated(config, path, content=f"# `{module}`\n\n::: {module}\n"))
    root = Path(config["config_file_path"]).parent
    for source in sorted((root / "results").rglob("*")):
        if source.is_file() and source.suffix in {".md", ".png", ".json"}:
            files.append(File(source.relative_to(root).as_posix(), src_dir=str(root), dest_dir=config["site_dir"],
                              use_directory_urls=config["use_directory_urls"]))
    return files
