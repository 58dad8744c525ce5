"""The web console: plain JavaScript modules and CSS served at ``/console``.

``server.mount_console(app, cp)`` adds it to the control plane's app.
``static/`` holds every file the browser loads (no build step, no CDN):
``index.html``, ``console.css``, ``js/main.js`` (sign-in, router, polling),
``js/api.js`` (the only module that calls the admin API), ``js/dom.js`` and
``js/charts.js`` (DOM and SVG helpers), ``js/actions.js`` (the buttons that
change the fleet), and one module per page under ``js/pages/``. Everything
shown comes from ``/admin/v1``, the same answers ``llmgw ctl`` prints.
"""
