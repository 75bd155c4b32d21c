"""Images at the edge: fetched (data: URLs; remote ones only where allowed), decoded, checked and
resized as the model's image processor resizes them before a request is prepared, so that
nothing past the route ever holds an image that is malformed, too large, or of a format not
served.

What is checked, each a 400 naming the part (``messages[0].content[1].image_url.url``):

- how many images one request holds (``--max-images``);
- the URL: ``data:`` with base64 (malformed base64 is refused), or ``http(s)`` only for a URL
  that starts with one of ``--image-url-allow`` (off by default: a server that fetches any URL a
  client names is a server-side request forgery hole into the network it sits in);
- the bytes (``--max-image-bytes``), before decoding and while fetching;
- the format, from the bytes, not the declared type: PNG, JPEG, WebP, GIF (its first frame);
- the pixels (``--max-image-pixels``), from the header, before anything is decompressed, so a
  decompression bomb is refused without being inflated;
- a truncated or corrupt file, when it is decoded.

Decoding runs in a worker thread, off the event loop. The result is
:class:`superfluid.core.media.Image`, kept on the part: RGB (transparency composited onto white,
as transformers' processors do), resized as the model's processor does it first
(:meth:`superfluid.core.media.VisionInfo.fit`: for SmolVLM, aspect ratio kept and the longest
edge to the processor's ``size["longest_edge"]``, with its filter; LLaVA-NeXT: left at its own
size, since its processor's base image, tiles and unpadding all start from the original pixels;
a model without processor settings: squeezed to its tile). Cutting it into tiles is the engine's encoder's (the same rules,
:mod:`superfluid.core.image_tiles`)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import warnings

import aiohttp
import attrs

from superfluid.core.errors import InvalidRequest
from superfluid.core.image_tiles import BICUBIC
from superfluid.core.media import Image, VisionInfo

from .options import OPTIONS

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


@attrs.define(frozen=True)
class ImageLimits:
    """The caps of ``--max-images``, ``--max-image-bytes``, ``--max-image-pixels``, and the
    remote URLs allowed (``--image-url-allow``) with their fetch timeout."""

    max_images: int = 8
    max_bytes: int = 20 << 20
    max_pixels: int = 32 << 20
    allow: tuple[str, ...] = ()
    fetch_timeout_s: float = 10.0

    @classmethod
    def of(cls, config) -> "ImageLimits":
        o = OPTIONS.of(config)
        return cls(max_images=o.max_images, max_bytes=o.max_image_mb << 20, max_pixels=o.max_image_pixels,
                   allow=tuple(o.image_url_allow), fetch_timeout_s=o.image_fetch_timeout)


def _bad(param: str, text: str, code: str = "invalid_image") -> InvalidRequest:
    return InvalidRequest(f"{param}: {text}", param=param, code=code)


class ImageLoader:
    """Loads a chat request's images for one front end's configuration."""

    def __init__(self, config):
        self.limits = ImageLimits.of(config)

    async def load(self, images, vision: VisionInfo) -> None:
        """Fetch, decode and check every image of a conversation (its
        :class:`~superfluid.core.formats.conversation.ImageRef` list, in order; each ``ref`` an
        :class:`~.content.ImagePart`), resized as ``vision`` (the model's layout) says, or raise
        the 400 of the first bad one, naming the field that sent it."""
        found = [(image.where, image.ref) for image in images]
        if len(found) > self.limits.max_images:
            raise InvalidRequest(f"{len(found)} images in one request; at most {self.limits.max_images} are allowed "
                                 "(--max-images)", param=found[self.limits.max_images][0], code="too_many_images")
        for param, part in found:
            if part.image is not None and vision.fit(part.image.width, part.image.height) == \
                    (part.image.width, part.image.height):
                continue  # loaded already (a fitted size fits again as it is)
            data = await self._bytes(param, part.url)
            part.loaded(await asyncio.to_thread(decode, data, param, vision, self.limits.max_pixels))

    async def _bytes(self, param: str, url: str) -> bytes:
        if url.startswith("data:"):
            return data_url_bytes(url, param, self.limits.max_bytes)
        if url.startswith(("http://", "https://")):
            if not any(url.startswith(prefix) for prefix in self.limits.allow):
                raise _bad(param, "remote image URLs are not fetched by this server (a server that fetches any "
                                  "URL a client names is a server-side request forgery hole); send the image as a "
                                  "data: URL, or allow its prefix with --image-url-allow", code="image_url_not_allowed")
            return await self._fetch(param, url)
        raise _bad(param, "must be a data: URL (data:image/png;base64,...) or an http(s) URL")

    async def _fetch(self, param: str, url: str) -> bytes:
        limit = self.limits.max_bytes
        timeout = aiohttp.ClientTimeout(total=self.limits.fetch_timeout_s)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session:
                async with session.get(url, allow_redirects=False) as resp:
                    if resp.status != 200:
                        raise _bad(param, f"fetching the image gave HTTP {resp.status}", code="image_fetch_failed")
                    data = await resp.content.read(limit + 1)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise _bad(param, f"the image could not be fetched ({type(exc).__name__})",
                       code="image_fetch_failed") from None
        if len(data) > limit:
            raise _bad(param, f"the image is larger than {limit} bytes (--max-image-mb)", code="image_too_large")
        return data


def data_url_bytes(url: str, param: str, max_bytes: int) -> bytes:
    """The bytes of a ``data:[<type>];base64,<data>`` URL, within ``max_bytes``."""
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise _bad(param, "a data: URL must be base64 (data:image/png;base64,...)")
    if len(payload) * 3 // 4 > max_bytes + 3:
        raise _bad(param, f"the image is larger than {max_bytes} bytes (--max-image-mb)", code="image_too_large")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(param, "malformed base64 in the data: URL") from None
    if not data:
        raise _bad(param, "the data: URL holds no bytes")
    if len(data) > max_bytes:
        raise _bad(param, f"the image is larger than {max_bytes} bytes (--max-image-mb)", code="image_too_large")
    return data


def decode(data: bytes, param: str, vision: VisionInfo | int, max_pixels: int) -> Image:
    """Decode, check and resize an image's bytes (see the module's docstring) for the model's
    layout ``vision`` (an int: squeezed to that many pixels a side)."""
    from PIL import Image as PILImage
    from PIL import UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", PILImage.DecompressionBombWarning)
            img = PILImage.open(io.BytesIO(data), formats=FORMATS)
            width, height = img.size
            if width <= 0 or height <= 0 or width * height > max_pixels:
                raise _bad(param, f"the image is {width}x{height} pixels, more than the {max_pixels} allowed "
                                  "(--max-image-pixels)", code="image_too_large")
            img.seek(0)  # an animated GIF: its first frame
            img.load()
            rgb = _rgb(img)
    except InvalidRequest:
        raise
    except UnidentifiedImageError:
        raise _bad(param, f"not an image in a served format ({', '.join(FORMATS)})",
                   code="unsupported_image_format") from None
    except (PILImage.DecompressionBombError, PILImage.DecompressionBombWarning):
        raise _bad(param, "the image decompresses to too many pixels (a decompression bomb)",
                   code="image_too_large") from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise _bad(param, f"the image is truncated or corrupt ({str(exc) or type(exc).__name__})") from None
    if isinstance(vision, int):
        size, resample = (vision, vision), BICUBIC
    else:
        size = vision.fit(*rgb.size)
        resample = vision.tiling.resample if vision.tiling is not None else \
            (vision.resample if vision.resample is not None else BICUBIC)
    if rgb.size != size:
        rgb = rgb.resize(size, resample)
    return Image.from_rgb(size[0], size[1], rgb.tobytes())


def _rgb(img):
    """RGB pixels as transformers' processors convert them: transparency (an alpha band, or a
    palette's transparent colour) composited onto white, not dropped."""
    from PIL import Image as PILImage

    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        return PILImage.alpha_composite(PILImage.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return img.convert("RGB")
