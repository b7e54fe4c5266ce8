-- A search hit carries the part of its message around the first match, not the whole message.
--
-- Up to 200 hits, each a message of up to ~100,000 characters, made one answer of tens of
-- megabytes (more once JSON escapes it), built in the daemon's memory, of which a client shows
-- a line. The hit's `message_id` loads the whole message where it is wanted.

-- The `width` characters of `content` around the first place `needle` occurs in it, ignoring
-- case as the search's ILIKE does (from a quarter of the width before it); the start when
-- `needle` is not found (a title's hit). A text no longer than `width` is whole. (lower()
-- keeps a text's length under the embedded server's C locale and libc collations; an ICU one
-- may change it, moving the cut a character per such letter before the match.)
CREATE FUNCTION search_excerpt(content text, needle text, width integer) RETURNS text
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
BEGIN
    IF length(content) <= width THEN
        RETURN content;
    END IF;
    RETURN substr(content,
                  greatest(1, least(strpos(lower(content), lower(needle)) - width / 4,
                                    length(content) - width + 1)),
                  width);
END;
$$;
