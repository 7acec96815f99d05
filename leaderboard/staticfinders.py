"""A staticfiles finder for plotly.min.js: served from the installed plotly package as
static/vendor/plotly.min.js (runserver and collectstatic both use it), so the site needs
no CDN and the repository no 4 MB copy."""
from pathlib import Path

from django.contrib.staticfiles.finders import BaseFinder
from django.core.files.storage import FileSystemStorage

PREFIX = "vendor"
FILENAME = "plotly.min.js"


def plotly_package_data() -> Path:
    import plotly

    return Path(plotly.__file__).resolve().parent / "package_data"


class PlotlyFinder(BaseFinder):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.location = plotly_package_data()
        self.storage = FileSystemStorage(location=str(self.location))
        self.storage.prefix = PREFIX  # collectstatic copies it to vendor/plotly.min.js

    def check(self, **kwargs):
        from django.core.checks import Error

        if not (self.location / FILENAME).is_file():
            return [Error(f"{self.location / FILENAME} is missing: reinstall plotly",
                          id="leaderboard.E001")]
        return []

    def find(self, path, find_all=False, **kwargs):
        if path == f"{PREFIX}/{FILENAME}":
            found = str(self.location / FILENAME)
            return [found] if find_all else found
        return [] if find_all else None

    def list(self, ignore_patterns):
        yield FILENAME, self.storage
