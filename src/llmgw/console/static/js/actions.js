// Buttons that change the fleet (unpark a model, cordon or drain a node):
// one behaviour on every page.

import { api } from "./api.js";
import { errorText } from "./dom.js";

/**
 * POST to `path` for `button`, disabled meanwhile. A refusal is told in
 * `flash` ("<what> failed: <why>") and the button can be clicked again; the
 * page is read again either way, so it shows what the fleet is now.
 */
export async function postAction(ctx, flash, button, path, what) {
  flash.textContent = "";
  button.disabled = true;
  try {
    await api(path, { method: "POST" });
  } catch (err) {
    flash.textContent = `${what} failed: ${errorText(err)}`;
    button.disabled = false;
  }
  await ctx.refreshNow();
}
