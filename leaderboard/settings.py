"""SpecBoard settings. Every setting comes from the environment; unset means the embedded
default (SQLite, a filesystem broker, files under var/), so that `make run` needs no server."""
import os
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

from csp.constants import NONE, SELF, UNSAFE_INLINE

from .env import database_from_url, env_bool, env_int, env_list, env_str, persistent_secret_key

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(env_str("SPECBOARD_VAR_DIR", str(BASE_DIR / "var")))
# Cache for demo assets (the converted demo target, package files).
DATA_DIR = Path(env_str("SPECBOARD_DATA_DIR", str(VAR_DIR / "data")))
# Trained drafters shipped with the repository (config.json + model.safetensors +
# training.json per folder); setup_demo registers them (leaderboard/services/shipping.py).
SHIPPED_DRAFTERS_DIR = Path(env_str("SPECBOARD_SHIPPED_DRAFTERS_DIR", str(BASE_DIR / "drafters")))
# Rounds of the demo training data shipped with the repository (services.training).
SHIPPED_ROUNDS_DIR = Path(env_str("SPECBOARD_SHIPPED_ROUNDS_DIR", str(BASE_DIR / "training-data" / "rounds")))

# DEBUG is off unless asked for (DEBUG=1): its error pages show source, settings and URLs.
DEBUG = env_bool("DEBUG", default=False)
# "production": the site is served behind TLS (docs/deployment.md): SECRET_KEY is required,
# cookies are secure, HTTP is redirected to HTTPS. "embedded" (`make run`, tests): a key
# generated once and kept under var/ stands in for SECRET_KEY.
DEPLOYMENT = env_str("SPECBOARD_DEPLOYMENT", "embedded")
if DEPLOYMENT not in ("embedded", "production"):
    raise ValueError(f"SPECBOARD_DEPLOYMENT {DEPLOYMENT!r}: use embedded or production")
SECRET_KEY = env_str("SECRET_KEY")
if not SECRET_KEY:
    if DEPLOYMENT == "production":
        raise RuntimeError("SECRET_KEY must be set when SPECBOARD_DEPLOYMENT=production")
    SECRET_KEY = persistent_secret_key(VAR_DIR / "secret_key")
if DEPLOYMENT == "production":
    SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = True
    SECURE_SSL_REDIRECT = env_bool("SPECBOARD_SSL_REDIRECT", True)
    # The TLS proxy in front says which requests came over HTTPS.
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    # HSTS is an option: once a browser has seen it, the host is HTTPS-only for this long.
    SECURE_HSTS_SECONDS = env_int("SPECBOARD_HSTS_SECONDS", 0)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SPECBOARD_HSTS_INCLUDE_SUBDOMAINS", False)
    SECURE_HSTS_PRELOAD = env_bool("SPECBOARD_HSTS_PRELOAD", False)
    if not SECURE_HSTS_SECONDS:
        # check --deploy's "HSTS not set": a deliberate choice here (SPECBOARD_HSTS_SECONDS).
        SILENCED_SYSTEM_CHECKS = ["security.W004"]

ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    # Swagger UI and ReDoc for /api/docs from the installed django-ninja (no CDN).
    "ninja",
    # Log-in lock-out on every log-in form, the admin's included (settings below).
    "axes",
    "csp",
    "leaderboard",
]
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",   # refuses a locked-out client before checking
    "django.contrib.auth.backends.ModelBackend",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # Static files (site CSS, plotly.js) served by the site itself, DEBUG or not.
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    # Every request's body size (and the submit page's rate) checked before anything reads
    # the body: its __call__ runs before every middleware's process_view, where the CSRF
    # check reads request.POST.
    "leaderboard.middleware.UploadGuardMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # A throttled request (django-ratelimit) is a 429 page (views.rate_limited).
    "django_ratelimit.middleware.RatelimitMiddleware",
    # The Content-Security-Policy header (CONTENT_SECURITY_POLICY below).
    "csp.middleware.CSPMiddleware",
    # django-axes: a locked-out log-in is a 429 page (AXES_* below); last, as it asks.
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "leaderboard.urls"
WSGI_APPLICATION = "leaderboard.wsgi.application"
ASGI_APPLICATION = "leaderboard.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {"default": database_from_url(env_str("DATABASE_URL"), VAR_DIR / "db.sqlite3")}
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    # A file, not memory, so that a Celery worker started by a test sees the test database.
    # One file per test process, so that two test runs on one machine never share it.
    DATABASES["default"]["TEST"] = {"NAME": str(VAR_DIR / f"test-db-{os.getpid()}.sqlite3")}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = VAR_DIR / "staticfiles"
# WhiteNoise serves from the finders when nothing was collected (`make run`, tests); it
# expects STATIC_ROOT to exist even then.
WHITENOISE_USE_FINDERS = DEPLOYMENT != "production"
if WHITENOISE_USE_FINDERS:
    STATIC_ROOT.mkdir(parents=True, exist_ok=True)

# Uploaded drafter files and run artifacts go through Django's storage API, so a shared
# volume (MEDIA_ROOT) or an object store (SPECBOARD_STORAGE_BACKEND, e.g.
# storages.backends.s3.S3Storage with its own AWS_* settings) serves remote workers.
MEDIA_ROOT = Path(env_str("MEDIA_ROOT", str(VAR_DIR / "media")))
MEDIA_URL = "media/"
STORAGES = {
    "default": {"BACKEND": env_str("SPECBOARD_STORAGE_BACKEND",
                                   "django.core.files.storage.FileSystemStorage")},
    # production: compressed, content-hashed names written by collectstatic (browsers cache
    # them for ever); embedded: files served straight from the source folders (no collectstatic).
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"
                    if DEPLOYMENT == "production"
                    else "django.contrib.staticfiles.storage.StaticFilesStorage"},
}

LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "home"
LOGOUT_REDIRECT_URL = "home"

# --- Celery -------------------------------------------------------------------------
# Embedded default: kombu's filesystem transport (no server). Production: redis://...
CELERY_BROKER_URL = env_str("CELERY_BROKER_URL", "filesystem://")
BROKER_DIR = VAR_DIR / "broker"
# The longest run we allow; the broker's visibility timeout must exceed it so that a
# slow run is never redelivered to a second worker while the first is still measuring.
RUN_HARD_LIMIT_S = env_int("SPECBOARD_RUN_HARD_LIMIT_S", 6 * 3600)
RUN_SOFT_LIMIT_S = env_int("SPECBOARD_RUN_SOFT_LIMIT_S", RUN_HARD_LIMIT_S - 300)
# A measuring worker waits this long for a database that stopped answering before it gives
# up a run (its cells are kept and written when the database is back).
DB_OUTAGE_WAIT_S = env_int("SPECBOARD_DB_OUTAGE_WAIT_S", 900)
# A running run whose worker has not written a heartbeat for this long is taken over.
RUN_STALE_AFTER_S = env_int("SPECBOARD_RUN_STALE_AFTER_S", 120)
HARDWARE_CLASSES = env_list("SPECBOARD_HARDWARE_CLASSES", ["cpu", "h100", "h200", "a100"])

CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": RUN_HARD_LIMIT_S + 3600}
if CELERY_BROKER_URL.startswith("filesystem://"):
    CELERY_BROKER_TRANSPORT_OPTIONS.update(
        data_folder_in=str(BROKER_DIR / "queue"),
        data_folder_out=str(BROKER_DIR / "queue"),
        processed_folder=str(BROKER_DIR / "processed"),
        # kombu keeps its exchange tables here; by default "control" in the working folder.
        control_folder=str(BROKER_DIR / "control"),
        store_processed=False,
    )
# Redis broker: a prefix on every key (queues, bindings), so that installations sharing one
# Redis database (the test suite beside `make run`: tests/isolation.py) never see or purge
# each other's messages.
BROKER_KEY_PREFIX = env_str("SPECBOARD_BROKER_KEY_PREFIX")
if BROKER_KEY_PREFIX and CELERY_BROKER_URL.startswith(("redis://", "rediss://")):
    CELERY_BROKER_TRANSPORT_OPTIONS["global_keyprefix"] = BROKER_KEY_PREFIX
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# A broker restart must not stop a measurement: the run goes on, finishes once (the claim is
# a compare-and-set), and a redelivered message finds it finished.
CELERY_WORKER_CANCEL_LONG_RUNNING_TASKS_ON_CONNECTION_LOSS = False
CELERY_RESULT_BACKEND = None  # outcomes live in the database (Run, Result)
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_WORKER_CONCURRENCY = 1
CELERY_TASK_SOFT_TIME_LIMIT = RUN_SOFT_LIMIT_S
CELERY_TASK_TIME_LIMIT = RUN_HARD_LIMIT_S
CELERY_TASK_DEFAULT_QUEUE = "web"
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_WORKER_HIJACK_ROOT_LOGGER = False

# Demo protocol size knobs (tests shrink them; the defaults finish in minutes on 2 cores).
# Prompts per task of the demo protocol's current version (v3) at batch sizes 4 and 8
# (batch size 1 measures the first 8); at least its largest batch size (8). MT-Bench gives
# math-reasoning at most 30.
DEMO_PROMPTS_PER_TASK = env_int("SPECBOARD_DEMO_PROMPTS_PER_TASK", 24)

# The host lock (worker.hostlock): a measurement holds it, so a second measurement on the
# same host waits and the Gradio demo yields (or labels its timings) while one runs.
HOST_LOCK = Path(env_str("SPECBOARD_HOST_LOCK", str(VAR_DIR / "host.lock")))
# How long the demo waits for the host lock before it generates anyway ("under contention").
DEMO_HOST_WAIT_S = env_int("SPECBOARD_DEMO_HOST_WAIT_S", 60)

# --- Gradio live demo (`manage.py demo`, run from .venv-demo) ----------------------------
# Where the site's /demo/ page finds the Gradio app (it embeds it in an iframe).
SPECBOARD_DEMO_URL = env_str("SPECBOARD_DEMO_URL", "http://127.0.0.1:7860/")

# Content-Security-Policy (django-csp): scripts only from this site's own files (no inline
# script or handler: static/leaderboard/forms.js binds the forms; charts read their figures
# from JSON blocks); inline styles allowed (plotly.js writes its own); the demo's Gradio
# app is the one other origin, framed by /demo/.
_demo = urlsplit(SPECBOARD_DEMO_URL)
CONTENT_SECURITY_POLICY = {"DIRECTIVES": {
    "default-src": [SELF],
    "script-src": [SELF],
    "style-src": [SELF, UNSAFE_INLINE],
    "img-src": [SELF, "data:"],
    "font-src": [SELF, "data:"],
    "connect-src": [SELF],
    "frame-src": [SELF] + ([f"{_demo.scheme}://{_demo.netloc}"] if _demo.netloc else []),
    "object-src": [NONE],
    "base-uri": [SELF],
    "form-action": [SELF],
    "frame-ancestors": [NONE],
}}
# Requests waiting in the demo's queue beyond the one generating (more are turned away).
DEMO_QUEUE_SIZE = env_int("SPECBOARD_DEMO_QUEUE_SIZE", 8)
# Generations one client address may have waiting or running at once (demo/client_limit.py).
DEMO_PER_CLIENT = env_int("SPECBOARD_DEMO_PER_CLIENT", 2)
# torch threads of the demo process (0: torch's default), so it cannot starve the workers.
DEMO_TORCH_THREADS = env_int("SPECBOARD_DEMO_TORCH_THREADS", 1)
# Longest prompt (tokens) and output the demo accepts.
DEMO_MAX_PROMPT_TOKENS = env_int("SPECBOARD_DEMO_MAX_PROMPT_TOKENS", 2048)
# Checked before tokenizing (and by the prompt box itself): about 4 characters a token.
DEMO_MAX_PROMPT_CHARS = env_int("SPECBOARD_DEMO_MAX_PROMPT_CHARS", 16000)
DEMO_MAX_NEW_TOKENS = env_int("SPECBOARD_DEMO_MAX_NEW_TOKENS", 512)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
    # kombu warns "No hostname was supplied" on every connection to the embedded
    # (filesystem) broker, which has no host: noise in every command that queues a run.
    "loggers": {"kombu.connection": {"level": "ERROR"}}
    if CELERY_BROKER_URL.startswith("filesystem://") else {},
}

# --- Pages and submissions ----------------------------------------------------------
# plotly.min.js is served from the installed plotly package (no CDN, no committed copy).
STATICFILES_FINDERS = [
    "django.contrib.staticfiles.finders.FileSystemFinder",
    "django.contrib.staticfiles.finders.AppDirectoriesFinder",
    "leaderboard.staticfinders.PlotlyFinder",
]
# Throttling (django-ratelimit; "N/period", period s, m, h or d, e.g. 10/15m): sign-ups and
# log-in attempts per client address, log-in attempts per user name, API tokens created per
# user. Counted in Django's cache: per web process unless SPECBOARD_CACHE_URL is redis://.
SPECBOARD_SIGNUP_RATE = env_str("SPECBOARD_SIGNUP_RATE", "5/h")
SPECBOARD_TOKEN_RATE = env_str("SPECBOARD_TOKEN_RATE", "10/h")
RATELIMIT_VIEW = "leaderboard.views.rate_limited"
# The client address every throttle keys on (leaderboard/clientip.py): REMOTE_ADDR, or
# behind this many trusted reverse proxies the address the outermost one saw, read from
# this header. Leave 0 unless every request reaches the site through the proxies.
SPECBOARD_TRUSTED_PROXIES = env_int("SPECBOARD_TRUSTED_PROXIES", 0)
SPECBOARD_FORWARDED_HEADER = env_str("SPECBOARD_FORWARDED_HEADER", "X-Forwarded-For")
RATELIMIT_IP_META_KEY = "leaderboard.clientip.client_ip"
# Log-in lock-out (django-axes), on /accounts/login/ and /admin/login/ alike: after
# SPECBOARD_LOGIN_FAILURES failed attempts from one client address, or for one user name,
# further attempts (the right password included) are a 429 for SPECBOARD_LOGIN_LOCKOUT_MINUTES;
# a successful log-in resets its counts.
AXES_FAILURE_LIMIT = env_int("SPECBOARD_LOGIN_FAILURES", 10)
AXES_COOLOFF_TIME = timedelta(minutes=env_int("SPECBOARD_LOGIN_LOCKOUT_MINUTES", 15))
AXES_LOCKOUT_PARAMETERS = ["ip_address", "username"]
AXES_CLIENT_IP_CALLABLE = "leaderboard.clientip.client_ip"
AXES_HTTP_RESPONSE_CODE = 429
AXES_LOCKOUT_TEMPLATE = "429.html"
AXES_RESET_ON_SUCCESS = True
AXES_VERBOSE = False
# Drafters one user may submit per 24 hours (staff are not limited; 0 = no limit).
SPECBOARD_SUBMISSIONS_PER_DAY = env_int("SPECBOARD_SUBMISSIONS_PER_DAY", 5)
# Largest upload (all files of one drafter together, archives as decompressed).
SPECBOARD_MAX_UPLOAD_BYTES = env_int("SPECBOARD_MAX_UPLOAD_BYTES", 20 * 1024 ** 3)
# Largest body of any other request (forms, API writes): refused with 413 before it is read
# (leaderboard/middleware.py); Django's own DATA_UPLOAD_MAX_MEMORY_SIZE leaves a multipart
# body's files unbounded, spooled to a temporary file.
SPECBOARD_MAX_REQUEST_BYTES = env_int("SPECBOARD_MAX_REQUEST_BYTES", 1024 ** 2)
# The model hub's token for gated or private drafters submitted by reference (worker/hub.py;
# the hub itself is HF_ENDPOINT, read by huggingface_hub, default huggingface.co).
SPECBOARD_HF_TOKEN = os.environ.get("SPECBOARD_HF_TOKEN", "")
# A sharded checkpoint may have many files (worker/checkpoint/ allows 256).
DATA_UPLOAD_MAX_NUMBER_FILES = 300
# The leaderboard table and the drafter page's results are cached per state of the data
# (Django's cache: per process by default) for this long; 0 turns the cache off.
SPECBOARD_PAGE_CACHE_SECONDS = env_int("SPECBOARD_PAGE_CACHE_SECONDS", 300)
# On: the leaderboard's figures are kept per run under the run's state
# (selectors.run_figures), so a landing cell recomputes one run, and one request renders a
# page's new state while others get its previous rendering (views.cached_fragment).
# Off: every request that misses renders from scratch (bench/web_load.py --before).
SPECBOARD_PAGE_CACHE_INCREMENTAL = env_bool("SPECBOARD_PAGE_CACHE_INCREMENTAL", True)
# While only running runs' cells land, a page is rendered again at most this often (seconds).
SPECBOARD_LANDING_REFRESH_S = env_int("SPECBOARD_LANDING_REFRESH_S", 5)
# Django's cache (the page fragments above): per process by default; SPECBOARD_CACHE_URL
# shares it between web processes: redis://HOST:PORT/DB or file:///absolute/folder.
# The per-process and folder caches hold up to 300 entries unless told: the leaderboard keeps
# one entry per run and filter (selectors.run_figures), so allow many more.
_cache_url = env_str("SPECBOARD_CACHE_URL")
_cache_options = {"MAX_ENTRIES": 50_000}
if _cache_url.startswith(("redis://", "rediss://")):
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache",
                          "LOCATION": _cache_url, "KEY_PREFIX": "specboard"}}
elif _cache_url.startswith("file://"):
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.filebased.FileBasedCache",
                          "LOCATION": _cache_url[len("file://"):], "OPTIONS": _cache_options}}
elif _cache_url:
    raise ValueError(f"SPECBOARD_CACHE_URL {_cache_url!r}: use redis://... or file:///path")
else:
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache",
                          "OPTIONS": _cache_options}}
